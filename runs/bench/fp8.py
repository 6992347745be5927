"""FP8 against bf16 on one GPU in one call (issue "Engine VII", item 5): the llama3.1-8b shape cut to 4 layers at
seq 8192, micro-batch 1, --global-batch-size micro-batches, bf16, distributed optimizer, every probe on, real text
(a corpus of pseudo-words, byte-level tokens: a loss that falls, unlike mock data's), --iters steps each:

    bf16      the engine as it runs today
    fp8       the same with --fp8-format hybrid --fp8-recipe tensorwise (torchao's float8 matmul in every layer linear)

First, one transformer layer of that shape alone (in-process): what its forward keeps for backward in bf16 and in
fp8, as autograd's saved tensors (each distinct storage, parameters aside; compiled on CUDA as the engine runs) and as
the allocator's growth while the output is held, so the ledger's activation formula can follow what the compiled
float8 matmul saves. Then, per run, the exact command, tokens/s (median of the steady steps: not the first, not the
profiled ones), the step's TFLOP/s and MFU in both conventions (Megatron's count over the 16-bit datasheet peak, and
over the fp8 peak) and the ledger's memory rows (`train-ledger reconcile`); then fp8 / bf16 tokens/s and the
two loss curves: the mean of the last 10 losses each and the spread of bf16's own last 10 (the noise the difference
is held against). Run directories go to OUT/runs.tgz (traces left out), figures to OUT/fp8.json.

    python runs/bench/fp8.py --out OUT [--iters 50] [--global-batch-size 4] [--seed N --no-layer]
        [--output-layer] [--runs bf16 fp8]    # the fp8 run with --fp8-output-layer; which runs to make
    python runs/bench/fp8.py --cpu-smoke --out /tmp/fp8    # the same code paths, tiny, emulated fp8, gloo
"""
from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "runs" / "bench"))

from data_and_checkpoint import corpus  # noqa: E402

SHAPE = ["--model", "llama3.1-8b", "--num-layers", "4", "--seq-length", "8192", "--max-position-embeddings", "8192"]
SMOKE_SHAPE = ["--model", "tiny", "--num-layers", "2", "--make-vocab-size-divisible-by", "128"]
ADAM = ["--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "5", "--weight-decay", "0.1", "--clip-grad", "1.0"]
FP8 = ["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]
LAST = 10  # losses averaged at the end of each curve


def cli(*argv: str) -> str:
    cmd = [sys.executable, "-m", "cli", *argv]
    print("$", shlex.join(cmd), flush=True)
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd[2:5])} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n"
                           f"{proc.stderr[-3000:]}")
    return proc.stdout


def steps(run: Path) -> list[dict]:
    with (run / "ranks/rank0/events.jsonl").open() as f:
        return [e for line in f if (e := json.loads(line))["kind"] == "step"]


def ledger_rows(run: Path, ledger: Path) -> dict[str, dict]:
    cli("reconcile", str(run), "--out", str(ledger))
    rows = json.loads((ledger / "reconciliation.json").read_text())["rows"]
    return {r["metric"]: r for r in rows if r.get("rank") in (None, 0)}


def figures(run: Path, rows: dict[str, dict]) -> dict:
    """tokens/s and the throughput rows the ledger judged on the steady steps; the memory rows' verdicts."""
    losses = [s["loss"] for s in steps(run)]
    pick = {k: rows[k]["measured"] for k in rows if k.startswith(("throughput.tokens_per_s", "throughput.mfu",
                                                                  "throughput.tflops_per_gpu"))}
    memory = {k: {f: rows[k].get(f) for f in ("predicted", "measured", "rel_diff", "verdict")}
              for k in rows if k.startswith("memory.")}
    step_time = rows.get("throughput.step_time", {})
    return {"losses": losses, "throughput": pick, "memory": memory,
            "step_time": {f: step_time.get(f) for f in ("predicted", "measured", "rel_diff", "verdict")}}


def layer_saved(fp8: bool, cpu: bool) -> dict:
    """One TransformerLayer's forward at the run's shape (the smoke's on CPU): the saved storages and the growth of
    allocated memory while its output is held (CUDA only)."""
    import torch

    from common.arguments import parse_args
    from engine.fp8_utils import convert_to_fp8
    from engine.tensor_parallel.mappings import TPGroup
    from engine.transformer.rotary import RotaryEmbedding
    from engine.transformer.transformer_layer import TransformerLayer

    cfg = parse_args([*(SMOKE_SHAPE if cpu else SHAPE), *(FP8 if fp8 else []), "--bf16"], world_size=1)
    m, device = cfg.model, torch.device("cpu" if cpu else "cuda")
    layer = TransformerLayer(m, 0, tp=TPGroup(None, 1, 0), sequence_parallel=False, params_dtype=torch.bfloat16,
                             device=device, seed=1)
    if fp8:
        convert_to_fp8([layer], cfg.implementation, device)
    cos, sin = RotaryEmbedding(m.head_dim, m.rotary_base)(m.seq_length, device, torch.bfloat16)
    x = torch.randn(m.seq_length, 1, m.hidden_size, device=device, dtype=torch.bfloat16, requires_grad=True)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    for _ in range(2):  # the first call compiles; the second is measured
        saved: dict[int, tuple] = {}

        def pack(t):
            storage = t.untyped_storage()
            if storage.data_ptr() not in params:
                saved[storage.data_ptr()] = (list(t.shape), str(t.dtype), storage.nbytes())
            return t

        before = torch.cuda.memory_allocated() if not cpu else 0
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            y = layer(x, cos, sin)
        kept = torch.cuda.memory_allocated() - before if not cpu else None
        y.sum().backward()
        del y
    return {"saved": sorted(saved.values(), key=lambda s: -s[2]), "saved_bytes": sum(s[2] for s in saved.values()),
            "allocated_while_held": kept}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--global-batch-size", type=int, default=4)
    ap.add_argument("--seed", type=int, help="the runs' --seed (another seed: the run-to-run noise of the losses)")
    ap.add_argument("--no-layer", action="store_true", help="skip the one-layer saved-set measurement")
    ap.add_argument("--output-layer", action="store_true", help="the fp8 run with --fp8-output-layer")
    ap.add_argument("--runs", nargs="+", choices=("bf16", "fp8"), default=["bf16", "fp8"])
    ap.add_argument("--cpu-smoke", action="store_true")
    a = ap.parse_args()
    out = a.out
    (out / "data").mkdir(parents=True, exist_ok=True)
    shape = SMOKE_SHAPE if a.cpu_smoke else SHAPE
    iters = 6 if a.cpu_smoke else a.iters
    seq = 32 if a.cpu_smoke else 8192
    corpus(out / "corpus.jsonl", 2 * iters * a.global_batch_size * (seq + 1))
    cli("preprocess", "--input", str(out / "corpus.jsonl"), "--json-key", "text", "--output-prefix",
        str(out / "data" / "corpus"))
    base = ["train", "--nproc-per-node", "1", *shape, "--use-distributed-optimizer", "--micro-batch-size", "1",
            "--global-batch-size", str(a.global_batch_size), "--train-iters", str(iters), *ADAM,
            "--data-path", str(out / "data" / "corpus"), "--split", "100,0,0", "--all-probes",
            "--use-pytorch-profiler", "--profile-step-start", str(iters - 2), "--profile-step-end", str(iters - 1)]
    if not a.cpu_smoke:
        base.append("--bf16")
    if a.seed is not None:
        base += ["--seed", str(a.seed)]
    result: dict = {"commands": {}, "layer_saved": {}}
    fp8 = FP8 + (["--fp8-output-layer"] if a.output_layer else [])
    for name, extra in [(n, e) for n, e in (("bf16", []), ("fp8", fp8)) if n in a.runs]:
        run = out / "runs" / name
        cli(*base, *extra, "--run-dir", str(run))
        result["commands"][name] = shlex.join(["train-ledger", *base, *extra, "--run-dir", str(run)])
        result[name] = figures(run, ledger_rows(run, out / "ledgers" / name))
        (out / "fp8.json").write_text(json.dumps(result, indent=1))
    # after the runs: this process's CUDA context and cache would otherwise sit on the GPU the runs are measured on
    for name, fp8_layer in () if a.no_layer else (("bf16", False), ("fp8", True)):
        result["layer_saved"][name] = saved = layer_saved(fp8_layer, a.cpu_smoke)
        print(f"one layer's forward, {name}: saved {saved['saved_bytes']:,} B, allocated while held "
              f"{saved['allocated_while_held']}", flush=True)
        for shape, dtype, nbytes in saved["saved"]:
            print(f"  {dtype:22s} {str(shape):24s} {nbytes:>14,}")
        (out / "fp8.json").write_text(json.dumps(result, indent=1))
    with tarfile.open(out / "runs.tgz", "w:gz") as tar:
        tar.add(out / "runs", arcname="runs", filter=lambda t: None if "/traces" in t.name else t)
    report(result)
    return 0


def report(result: dict) -> None:
    for name in ("bf16", "fp8"):
        if name not in result:
            continue
        r = result[name]
        print(f"\n{name}: {result['commands'][name]}")
        for metric, value in sorted(r["throughput"].items()):
            print(f"  {metric:40s} {value}")
        print(f"  step time: {r['step_time']}")
        for metric, row in sorted(r["memory"].items()):
            print(f"  {metric:40s} predicted {row['predicted']} measured {row['measured']} rel_diff {row['rel_diff']} "
                  f"{row['verdict']}")
    if "bf16" not in result or "fp8" not in result:
        return
    bf16, fp8 = result["bf16"], result["fp8"]
    speed = fp8["throughput"]["throughput.tokens_per_s"] / bf16["throughput"]["throughput.tokens_per_s"]
    tail = {name: result[name]["losses"][-LAST:] for name in ("bf16", "fp8")}
    print(f"\nfp8 / bf16 tokens/s: {speed:.3f}")
    print(f"mean of the last {LAST} losses: bf16 {statistics.mean(tail['bf16']):.4f} fp8 "
          f"{statistics.mean(tail['fp8']):.4f}; bf16's own spread (stdev) {statistics.stdev(tail['bf16']):.4f}")
    for step, (x, y) in enumerate(zip(bf16["losses"], fp8["losses"]), 1):
        print(f"  step {step:3d}  bf16 {x:.4f}  fp8 {y:.4f}  diff {y - x:+.4f}")


if __name__ == "__main__":
    sys.exit(main())
