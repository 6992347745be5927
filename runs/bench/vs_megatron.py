"""Our engine against megatron-core and torch.compile on one GPU, side by side in one process tree.

Variants, alternated A B C A B C per sequence length so that drift (clocks, thermals, neighbours) hits all:
  A megatron-core GPTModel (local spec + SDPA core attention, fused AdamW, DistributedOptimizer, fp32 grad buffer)
    through the anchor harness runs/bench/anchors/mcore_anchor.py (the megatron-core wheel installed: its README);
  B plain PyTorch + torch.compile through runs/bench/anchors/torch_anchor.py --compile;
  torchtitan's Llama 3 model with its parallelize_llama (0.3.0: FSDP2, FlexAttention; 0.2.2: autocast, SDPA on one
    GPU; per-block compile either way) through
    runs/bench/anchors/torchtitan_anchor.py ("torchtitan": its wheel and pure-Python dependencies installed);
  C train-ledger's engine: --bf16 --use-distributed-optimizer, every probe on except the profiler window
    (--all-probes), launched through torchrun like a user would; "ours-eager" is the same with
    TRAIN_LEDGER_COMPILE=0 (no compiled pointwise fusions), to show what the fusions buy.
A variant that fails is reported as failed and the others still run.
Same shape (llama3.2-1b), synthetic tokens, micro-batch 1, --microbatches per step, the same Adam hyper-parameters.

Per variant: tokens/s (mean of the last --timed steps, as the anchors report it), step time median and spread,
TFLOP/s per GPU and MFU under Megatron-LM's FLOPs formula against the datasheet peak (989 TFLOP/s) and against the
bf16 GEMM ceiling measured at start-up, peak allocated / reserved memory, and (ours) bytes per parameter after
setup and after the first step from the run directory. Writes one JSON with every run and prints a table.

    python runs/bench/vs_megatron.py --seq 4096 8192 --microbatches 8 --rounds 2 --out result.json
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.arguments import parse_args  # noqa: E402
from common.events import InventoryRecord, MemoryRecord, NvmlRecord, StepRecord  # noqa: E402
from common.run_dir import iter_events  # noqa: E402
from ledger.models.formulas.flops import H200_BF16_DENSE_PEAK, megatron_flops_per_step  # noqa: E402

ADAM = ["--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "1", "--weight-decay", "0.1", "--adam-beta1", "0.9",
        "--adam-beta2", "0.95", "--clip-grad", "1.0"]


def engine_argv(seq: int, microbatches: int, steps: int, run_dir: str,
                probes: tuple[str, ...] = ("--all-probes",)) -> list[str]:
    """Untied, as both anchors build the model (share_embeddings_and_output_weights=False; a separate nn.Linear)."""
    return ["--model", "llama3.2-1b", "--untie-embeddings-and-output-weights", "--seq-length", str(seq), "--bf16",
            "--use-distributed-optimizer", "--micro-batch-size", "1", "--global-batch-size", str(microbatches),
            "--train-iters", str(steps), *ADAM, *probes, "--run-dir", run_dir]


CEILING = """
import time, torch
a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
for _ in range(3):
    a @ b
torch.cuda.synchronize()
start, reps = time.perf_counter(), 20
for _ in range(reps):
    a @ b
torch.cuda.synchronize()
print(2 * 8192 ** 3 * reps / (time.perf_counter() - start) / 1e12)
"""


def gemm_ceiling_tflops() -> float:
    """A square bf16 GEMM's TFLOP/s, in a child process: this harness must hold no CUDA context while the runs it
    launches are measured (NVML counts every process on the GPU; a context and this GEMM's cache held ~1 GiB)."""
    out, _ = run([sys.executable, "-c", CEILING], timeout=300)
    return float(out.strip().splitlines()[-1])


def run(cmd: list[str], timeout: int, env: dict[str, str] | None = None) -> tuple[str, float]:
    print("$ " + "".join(f"{k}={v} " for k, v in (env or {}).items()) + shlex.join(cmd), flush=True)
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    if proc.returncode != 0:
        raise RuntimeError(f"{cmd[:4]} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc.stdout, time.perf_counter() - start


def anchor_variant(name: str, script: Path, extra: list[str], seq: int, mb: int, steps: int, timed: int) -> dict:
    out, wall = run([sys.executable, str(script), "--seq", str(seq), "--microbatches", str(mb), "--steps", str(steps),
                     "--timed", str(timed), *extra], timeout=900)
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
    res = json.loads(line[len("RESULT "):])
    times = res["times"][-timed:]
    return dict(variant=name, seq=seq, times=times, peak_alloc=res["peak_alloc"], peak_reserved=res["peak_reserved"],
                mem_setup=res["mem_setup"]["alloc"], mem_after_step1=res["mem_after_step1"]["alloc"],
                n_params=res["n_params"], wall_s=wall, versions={k: res.get(k) for k in ("torch", "megatron_core")})


# Engine levers a variant may turn on (flags added to engine_argv's): the output layer fused into the loss.
CUDA_GRAPHS = ["--cuda-graph-impl", "local"]  # every layer replayed from CUDA graphs
LINEAR_CROSS_ENTROPY = ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "linear"]
FUSED_ATTENTION = ["--attention-backend", "fused"]  # cuDNN's fused attention kernel
DENSE_EMBEDDING_GRAD = ["--no-embedding-gradient-accumulation-fusion"]  # the lookup's dense gradient, as Megatron


def engine_variant(seq: int, mb: int, steps: int, timed: int, compile_: bool = True, extra: tuple[str, ...] = (),
                   name: str | None = None, keep: Path | None = None) -> dict:
    """Our engine at the anchors' shape; compile_=False sets TRAIN_LEDGER_COMPILE=0 (the eager model, engine/jit.py);
    extra: flags added to engine_argv's (a lever), reported under `name`; keep: a folder the run directory is kept
    in (for the ledger), else a temporary one."""
    variant = name or ("train-ledger" if compile_ else "train-ledger eager")
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / "run" if keep is None else keep / f"{variant.replace(' ', '_')}_s{seq}_{time.time_ns()}"
        result = engine_run(engine_argv(seq, mb, steps, str(run_dir)) + list(extra), timed,
                            {"TRAIN_LEDGER_COMPILE": "1" if compile_ else "0"})
    return dict(result, variant=variant, seq=seq, run_dir=str(run_dir) if keep is not None else None)


def engine_run(argv: list[str], timed: int, env: dict[str, str] | None = None) -> dict:
    """`torchrun --nproc-per-node 1 -m engine.train ARGV` (ARGV names its --run-dir) and the figures of its rank 0
    events: the last `timed` step times and tokens per step, the allocator's peaks (None where it keeps none: CPU),
    NVML's device used bytes at their highest (the nvml probe) and what lay outside PyTorch then (used - reserved)."""
    run_dir = argv[argv.index("--run-dir") + 1]
    _, wall = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1",
                   "-m", "engine.train", *argv], timeout=900, env=env)
    events = list(iter_events(run_dir, 0))
    steps_ = [e for e in events if isinstance(e, StepRecord)]
    memory = {e.point: e for e in events if isinstance(e, MemoryRecord) and e.point != "step"}
    per_step = [e for e in events if isinstance(e, MemoryRecord) and e.point == "step"]
    inventory = [e for e in events if isinstance(e, InventoryRecord) and e.tensor_kind == "param_buffer"]
    nvml = [e.used_without_others for e in events if isinstance(e, NvmlRecord) and e.used_bytes is not None]
    peak_reserved = _largest([m.reserved for m in per_step])
    return dict(times=[s.step_time_s for s in steps_][-timed:], tokens_per_step=steps_[-1].tokens,
                losses=[s.loss for s in steps_],
                peak_alloc=_largest([m.peak for m in per_step]), peak_reserved=peak_reserved,
                nvml_used_max=max(nvml) if nvml else None,
                outside_pytorch=max(nvml) - peak_reserved if nvml and peak_reserved is not None else None,
                mem_setup=memory["after_optimizer_init"].allocated,
                mem_after_step1=memory["after_first_step"].allocated,
                n_params=sum(e.numel for e in inventory) or None,
                lifecycle_allocated={point: m.allocated for point, m in memory.items()},
                wall_s=wall, argv=["torchrun", "--nproc-per-node", "1", "-m", "engine.train", *argv])


def _largest(values: list[int | None]) -> int | None:
    """The largest of the figures a record has (None where none has it: the allocator keeps none on CPU)."""
    present = [v for v in values if v is not None]
    return max(present) if present else None


def summarize(r: dict, mb: int, ceiling: float) -> dict:
    cfg = parse_args(engine_argv(r["seq"], mb, 10, "x"), world_size=1)
    flops = megatron_flops_per_step(cfg)
    mean = sum(r["times"]) / len(r["times"])
    tflops = flops / mean / 1e12
    return dict(variant=r["variant"], seq=r["seq"], tokens_per_s=mb * r["seq"] / mean,
                step_median_ms=statistics.median(r["times"]) * 1e3,
                step_spread_ms=(max(r["times"]) - min(r["times"])) * 1e3, tflops_per_gpu=tflops,
                mfu_datasheet=tflops * 1e12 / H200_BF16_DENSE_PEAK, mfu_gemm_ceiling=tflops / ceiling,
                peak_alloc_gib=_gib(r["peak_alloc"]), peak_reserved_gib=_gib(r["peak_reserved"]),
                bytes_per_param_setup=r["mem_setup"] / r["n_params"] if r["n_params"] and r["mem_setup"] else None,
                bytes_per_param_step1=(r["mem_after_step1"] / r["n_params"] if r["n_params"] and r["mem_after_step1"]
                                       else None),
                nvml_used_gib=_gib(r.get("nvml_used_max")), outside_pytorch_gib=_gib(r.get("outside_pytorch")))


def _gib(n: int | None) -> float | None:
    return n / 2 ** 30 if n is not None else None


def variant_makers(anchors: Path, mb: int, steps: int, timed: int, keep: Path | None = None) -> dict:
    """--variants name -> a function of the sequence length that runs it and returns its raw record; `keep`: where
    our runs' directories stay."""
    return {
        "mcore": lambda s: anchor_variant("megatron-core", anchors / "mcore_anchor.py",
                                          ["--attn", "sdpa", "--fusedadam"], s, mb, steps, timed),
        "compile": lambda s: anchor_variant("torch.compile", anchors / "torch_anchor.py", ["--compile"], s, mb, steps,
                                            timed),
        "torchtitan": lambda s: anchor_variant("torchtitan", anchors / "torchtitan_anchor.py", [], s, mb, steps, timed),
        "ours": lambda s: engine_variant(s, mb, steps, timed, keep=keep),
        "ours-eager": lambda s: engine_variant(s, mb, steps, timed, compile_=False, keep=keep),
        "ours-linear-ce": lambda s: engine_variant(s, mb, steps, timed, extra=LINEAR_CROSS_ENTROPY,
                                                   name="train-ledger linear-ce", keep=keep),
        "ours-graphed": lambda s: engine_variant(s, mb, steps, timed, extra=CUDA_GRAPHS, name="train-ledger graphed",
                                                 keep=keep),
        "ours-fused-attention": lambda s: engine_variant(s, mb, steps, timed, extra=FUSED_ATTENTION,
                                                         name="train-ledger fused-attention", keep=keep),
        "ours-dense-embedding-grad": lambda s: engine_variant(s, mb, steps, timed, extra=DENSE_EMBEDDING_GRAD,
                                                              name="train-ledger dense-embedding-grad", keep=keep),
    }


def merged_table(raw: list[dict], seqs: list[int], mb: int, ceiling: float) -> tuple[list[dict], dict]:
    """Each variant's runs of a sequence length merged (their timed steps pooled) and summarised, and each of our
    variants' tokens/s over each anchor's and over our default's (a lever's gain)."""
    table = []
    for seq in seqs:
        for v in sorted({r["variant"] for r in raw if r["seq"] == seq}):
            runs = [r for r in raw if r["variant"] == v and r["seq"] == seq]
            merged = dict(runs[0], times=[t for r in runs for t in r["times"]])
            table.append(summarize(merged, mb, ceiling))
    by = {(t["variant"], t["seq"]): t for t in table}
    ours = sorted({v for v, _ in by if v.startswith("train-ledger")})
    others = ("megatron-core", "torch.compile", "torchtitan", "train-ledger")  # the anchors, and our default
    ratios = {seq: {f"{mine} / {other}": by[(mine, seq)]["tokens_per_s"] / by[(other, seq)]["tokens_per_s"]
                    for mine in ours for other in others if mine != other and (mine, seq) in by and (other, seq) in by}
              for seq in seqs}
    return table, ratios


def print_table(table: list[dict], ratios: dict) -> None:
    print("\nvariant                  seq   tokens/s  median ms  spread ms  TFLOP/s  MFU(989)  MFU(gemm)  "
          "peak alloc GiB")
    for t in sorted(table, key=lambda t: (t["seq"], t["variant"])):
        print(f"{t['variant']:<23} {t['seq']:>5} {t['tokens_per_s']:>10,.0f} {t['step_median_ms']:>10.1f} "
              f"{t['step_spread_ms']:>10.1f} {t['tflops_per_gpu']:>8.1f} {t['mfu_datasheet']:>9.3f} "
              f"{t['mfu_gemm_ceiling']:>10.3f} {t['peak_alloc_gib'] or 0:>14.2f}")
    print("ratios (ours / other, tokens/s):", json.dumps(ratios), flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--anchors", default=str(ROOT / "runs" / "bench" / "anchors"),
                   help="folder holding mcore_anchor.py and torch_anchor.py")
    p.add_argument("--seq", type=int, nargs="+", default=[4096, 8192])
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--timed", type=int, default=8)
    p.add_argument("--variants", nargs="+", default=["mcore", "compile", "ours"])
    p.add_argument("--out", default="vs_megatron.json")
    p.add_argument("--keep-runs", type=Path, help="keep our runs' directories here (for train-ledger reconcile)")
    a = p.parse_args()
    print("command: python " + shlex.join(sys.argv), flush=True)
    ceiling = gemm_ceiling_tflops()
    print(f"bf16 GEMM ceiling (8192^3, random): {ceiling:.0f} TFLOP/s", flush=True)
    makers = variant_makers(Path(a.anchors), a.microbatches, a.steps, a.timed, a.keep_runs)
    raw: list[dict] = []
    failures: list[dict] = []
    for seq in a.seq:
        for _ in range(a.rounds):
            for v in a.variants:
                try:
                    raw.append(makers[v](seq))
                except (RuntimeError, subprocess.TimeoutExpired, StopIteration, KeyError) as exc:
                    failures.append({"variant": v, "seq": seq, "error": str(exc)[-2000:]})
                    print(f"FAILED {v} seq {seq}: {str(exc)[-2000:]}", flush=True)
                    continue
                print(json.dumps(summarize(raw[-1], a.microbatches, ceiling)), flush=True)
    table, ratios = merged_table(raw, a.seq, a.microbatches, ceiling)
    print_table(table, ratios)
    Path(a.out).write_text(json.dumps({"command": sys.argv, "gemm_ceiling_tflops": ceiling, "table": table,
                                       "ratios": ratios, "runs": raw,
                                       "failures": failures}, indent=1))


if __name__ == "__main__":
    main()
