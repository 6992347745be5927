"""Engine VII on one GPU in one call (runs/bench/engine_vii_h200.sh): what each of the issue's levers does, each
figure beside the exact command that made it.

Sections, in priority order, each with a share of --budget-s (ENDS): a run that would end past its section's share is
skipped, and says so:
  dense   llama3.2-1b at seq 4096, 8 micro-batches of 1, bf16, distributed optimizer, every probe on (vs_megatron.py's
          shape and flags): our engine ("ours") and megatron-core alternated over --rounds, and in the first
          --lever-rounds our engine with each of --levers (the fused linear cross-entropy, "ours-linear-ce"; every
          layer replayed from CUDA graphs, "ours-graphed", not on --cpu-smoke): tokens/s, TFLOP/s, MFU
          against the 989 TFLOP/s datasheet, peak allocated, NVML's used bytes and what lay outside PyTorch (a
          one-GPU run now builds no communicator beyond the default group's), ratios to megatron-core;
  moe     mixtral-8x7b-2l on the one GPU (runs/bench/moe_cp_h200.sh's flags) with SequentialMLP, with its rows
          padded to multiples of 128, with --moe-grouped-gemm, and megatron-core's MoE at the same shape
          (--moe-variants; mcore_anchor.py --moe: its SequentialMLP, no Transformer Engine): step time, tokens/s,
          the ratios, and from one profiled step's trace the forward passes' GPU idle (1 - kernel busy time / the
          forward's GPU window: first to last kernel it launched) and the step's top kernels;
  small   a launch-bound shape (hidden 1024, 4 layers, 16 heads in 4 groups, vocab 32000, seq 512, micro-batch 2, 8
          micro-batches) eager (TRAIN_LEDGER_COMPILE=0), compiled (the engine's default) and compiled with every
          layer replayed from CUDA graphs (--cuda-graph-impl local), alternated over --rounds: tokens/s, the ratios
          to the compiled and the eager run, and whether the graphed run's losses equal the compiled run's bit for
          bit (the same kernels, replayed);
  outside the ledger's prediction of memory outside PyTorch on one H200 for this engine and for the engine that built
          a communicator for every group, beside the dense runs' NVML figure.
The JSON (--out) is rewritten after every run, so a section cut short keeps what it measured.

    python runs/bench/engine_vii.py --out OUT/engine_vii.json [--budget-s 470]
    python runs/bench/engine_vii.py --cpu-smoke --out /tmp/engine_vii.json   # the same code paths, tiny, on CPU
"""
from __future__ import annotations

import argparse
import gzip
import json
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "runs" / "bench"))

from vs_megatron import (  # noqa: E402
    anchor_variant,
    engine_run,
    gemm_ceiling_tflops,
    merged_table,
    print_table,
    summarize,
    variant_makers,
)

from common.arguments import parse_args  # noqa: E402
from common.intervals import union  # noqa: E402
from common.run_dir import trace_files  # noqa: E402
from ledger.models.formulas.device_memory import DeviceOverheads, outside_pytorch  # noqa: E402

MOE = ["--model", "mixtral-8x7b-2l", "--bf16", "--micro-batch-size", "1", "--global-batch-size", "8",
       "--moe-aux-loss-coeff", "0.02", "--all-probes", "--use-pytorch-profiler"]
SMALL = ["--model", "llama3.2-1b", "--num-layers", "4", "--hidden-size", "1024", "--ffn-hidden-size", "4096",
         "--num-attention-heads", "16", "--num-query-groups", "4", "--vocab-size", "32000", "--seq-length", "512",
         "--micro-batch-size", "2", "--global-batch-size", "16", "--bf16", "--use-distributed-optimizer",
         "--all-probes"]
# --cpu-smoke's stand-ins: the tiny shapes, a few steps, gloo.
SMOKE_DENSE = ["--model", "tiny", "--vocab-size", "1000", "--seq-length", "32", "--max-position-embeddings", "32"]
SMOKE_MOE = ["--model", "tiny", "--num-experts", "4", "--moe-router-topk", "2", "--micro-batch-size", "1",
             "--global-batch-size", "4", "--all-probes", "--use-pytorch-profiler"]
SMOKE_SMALL = ["--model", "tiny", "--micro-batch-size", "2", "--global-batch-size", "4", "--all-probes"]
# Seconds one run of a section is expected to take once the compile and sweep caches are warm (estimates: a run
# starts torchrun, builds the model, sweeps, compiles, trains), and the share of the budget by whose end a section's
# last run must be done, so that a slow dense section leaves the later ones their time.
RUN_S = {"dense": 45, "moe": 75, "small": 30, "outside": 0}
ENDS = {"dense": 0.55, "moe": 0.88, "small": 1.0, "outside": 1.0}
SECTIONS = tuple(RUN_S)


class Budget:
    def __init__(self, seconds: float):
        self.seconds, self.start = seconds, time.monotonic()

    @property
    def left(self) -> float:
        return self.seconds - (time.monotonic() - self.start)

    def may_start(self, section: str, what: str) -> bool:
        """Whether a run of `section` started now ends inside the section's share; says so when not."""
        elapsed = time.monotonic() - self.start
        if elapsed + RUN_S[section] <= ENDS[section] * self.seconds:
            return True
        print(f"SKIPPED {section} {what}: {elapsed:.0f} s of {self.seconds:.0f} gone, the section's share ends at "
              f"{ENDS[section] * self.seconds:.0f} s and a run takes ~{RUN_S[section]} s", flush=True)
        return False


def trace_events(trace: Path) -> list[dict]:
    """A gzipped Kineto trace's events, read once for every figure taken from it (it can be hundreds of MB)."""
    with gzip.open(trace, "rt") as f:
        return json.load(f)["traceEvents"]


def forward_gpu_idle(events: list[dict]) -> dict | None:
    """Over the profiled step's forward ranges ("forward stage0 mbN"): each one's GPU window (first start to last end
    of the kernels, copies and memsets it launched, matched by correlation id) and the union of all device work
    inside it. None on a trace without device work (CPU)."""
    launched = {e["args"]["correlation"]: e["ts"] for e in events
                if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
    device = [(e["ts"], e["ts"] + e.get("dur", 0), e.get("args", {}).get("correlation")) for e in events
              if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    forwards = [(e["ts"], e["ts"] + e["dur"]) for e in events
                if e.get("cat") == "user_annotation" and e.get("name", "").startswith("forward ")]
    if not device or not forwards:
        return None
    windows, busy = [], []
    for start, end in forwards:
        mine = [(s, e) for s, e, c in device if c in launched and start <= launched[c] <= end]
        if not mine:
            continue
        lo, hi = min(s for s, _ in mine), max(e for _, e in mine)
        inside = union([(max(s, lo), min(e, hi)) for s, e, _ in device if e > lo and s < hi])
        windows.append((hi - lo, end - start))
        busy.append(sum(e - s for s, e in inside))
    gpu_window = sum(w for w, _ in windows)
    return {"forwards": len(windows), "cpu_ms_mean": sum(c for _, c in windows) / len(windows) / 1e3,
            "gpu_window_ms_mean": gpu_window / len(windows) / 1e3,
            "kernel_busy_ms_mean": sum(busy) / len(windows) / 1e3, "gpu_idle_fraction": 1 - sum(busy) / gpu_window}


def top_kernels(events: list[dict], top: int = 12) -> list[dict] | None:
    """The profiled step's kernels by total time, grouped by name: what a lever's time went to. None on CPU."""
    kernels = [e for e in events if e.get("cat") == "kernel"]
    if not kernels:
        return None
    total: dict[str, list[float]] = {}
    for k in kernels:
        total.setdefault(k["name"], []).append(k.get("dur", 0))
    rows = sorted(total.items(), key=lambda item: -sum(item[1]))[:top]
    return [{"kernel": name[:100], "ms": sum(d) / 1e3, "calls": len(d), "median_us": sorted(d)[len(d) // 2]}
            for name, d in rows]


def trained(argv: list[str], timed: int, env: dict[str, str] | None = None) -> dict:
    """engine_run in a run directory of its own, with tokens/s and, where the run was profiled, its trace's forward
    GPU idle and top kernels (the trace is read here, not kept: it can be hundreds of MB)."""
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = str(Path(tmp) / "run")
        result = engine_run([*argv, "--run-dir", run_dir], timed, env)
        traces = trace_files(run_dir)
        events = trace_events(traces[0][3]) if traces else None
        result["forward_idle"] = forward_gpu_idle(events) if events is not None else None
        result["top_kernels"] = top_kernels(events) if events is not None else None
    mean = sum(result["times"]) / len(result["times"])
    result.update(step_ms_mean=mean * 1e3, tokens_per_s=result["tokens_per_step"] / mean)
    return result


def dense(a, budget: Budget, out: dict, save) -> None:
    makers = variant_makers(Path(a.anchors), 8, a.steps, a.timed)
    pair = ["ours"] + ([] if a.cpu_smoke else ["mcore"])
    levers = [v for v in a.levers if not (a.cpu_smoke and v == "ours-graphed")]  # graphs need CUDA
    if a.cpu_smoke:
        makers = {v: (lambda seq, v=v: smoke_variant(v, a)) for v in [*pair, *levers]}
    raw, seq = [], 32 if a.cpu_smoke else 4096
    out["dense"] = {"runs": raw, "failures": []}
    for round_ in range(a.rounds):  # the levers' runs in the first --lever-rounds rounds only
        for v in pair + (levers if round_ < a.lever_rounds else []):
            if not budget.may_start("dense", f"{v} round {round_ + 1}"):
                continue
            try:
                raw.append(makers[v](seq))
            except (RuntimeError, subprocess.TimeoutExpired, StopIteration, KeyError) as exc:
                out["dense"]["failures"].append({"variant": v, "error": str(exc)[-2000:]})
                print(f"FAILED {v}: {str(exc)[-2000:]}", flush=True)
                continue
            print(json.dumps(summarize(raw[-1], 8, out["gemm_ceiling_tflops"])), flush=True)
            save()
    if raw:
        table, ratios = merged_table(raw, [seq], 8, out["gemm_ceiling_tflops"])
        out["dense"].update(table=table, ratios=ratios)
        print_table(table, ratios)
        save()


def smoke_variant(variant: str, a) -> dict:
    """--cpu-smoke's stand-in for a dense variant: the tiny model with that variant's lever, summarised like one."""
    extra = ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "linear"] if variant.endswith("ce") else []
    r = trained([*SMOKE_DENSE, "--global-batch-size", "8", "--train-iters", str(a.steps), "--all-probes", *extra],
                a.timed)
    return dict(r, variant=f"train-ledger{' linear-ce' if extra else ''}", seq=32)


MOE_VARIANTS = {"sequential": [], "grouped-gemm": ["--moe-grouped-gemm"],
               "grouped-gemm-delayed": ["--moe-grouped-gemm", "--moe-delay-expert-wgrad"],
               # few GEMM shapes: no per-shape kernel choice on the host mid-step (docs/engine.md)
               "sequential-padded": ["--moe-pad-expert-rows", "128"],
               "sequential-padded-16": ["--moe-pad-expert-rows", "16"],
               # each expert's weight gradients once a step over all micro-batches' rows (docs/engine.md)
               "sequential-delayed": ["--moe-pad-expert-rows", "16", "--moe-delay-expert-wgrad"],
               # the embedding's dense gradient (Megatron's way), the lever the default's lookup fusion is measured by
               "sequential-dense-embedding-grad": ["--no-embedding-gradient-accumulation-fusion"]}


def moe(a, budget: Budget, out: dict, save) -> None:
    """Ours (--moe-variants of MOE_VARIANTS) and, on a GPU, megatron-core's MoE (its SequentialMLP through
    mcore_anchor.py --moe, the same shape) when "mcore" is among them; every pair's ratio. A variant named twice
    (alternated runs) is kept under "name #2" the second time."""
    base = SMOKE_MOE if a.cpu_smoke else MOE
    steps = a.steps
    flags = ["--train-iters", str(steps), "--profile-step-start", str(steps - 1), "--profile-step-end", str(steps - 1)]
    out["moe"] = {}
    for i, variant in enumerate(a.moe_variants):
        if not budget.may_start("moe", variant) or (variant == "mcore" and a.cpu_smoke):
            continue
        repeat = a.moe_variants[:i].count(variant)
        name = f"{variant} #{repeat + 1}" if repeat else variant
        if variant == "mcore":
            r = anchor_variant("megatron-core MoE", Path(a.anchors) / "mcore_anchor.py",
                               ["--attn", "sdpa", "--fusedadam", "--moe"], 4096, 8, steps, a.timed)
            mean = sum(r["times"]) / len(r["times"])
            out["moe"][name] = r = dict(r, step_ms_mean=mean * 1e3, tokens_per_s=8 * 4096 / mean, forward_idle=None)
        else:
            out["moe"][name] = r = trained([*base, *flags, *MOE_VARIANTS[variant]], a.timed)
        save()
        print(f"moe {name}: {r['step_ms_mean']:.1f} ms/step, {r['tokens_per_s']:,.0f} tokens/s, forward idle "
              f"{json.dumps(r['forward_idle'])}", flush=True)
        for k in r.get("top_kernels") or []:
            print(f"  {k['ms']:8.2f} ms {k['calls']:5d} calls, median {k['median_us']:7.1f} us  {k['kernel']}")
    ran = list(out["moe"])  # every pair, in the order they ran (mcore last where it ran last)
    ratios = {f"{mine} / {other}": out["moe"][mine]["tokens_per_s"] / out["moe"][other]["tokens_per_s"]
              for i, mine in enumerate(ran) for other in ran[i + 1:]}
    out["moe"]["ratios"] = ratios
    print(f"moe tokens/s ratios: {json.dumps(ratios)}", flush=True)
    save()


SMALL_VARIANTS = {"eager": ("0", []), "compiled": ("1", []), "graphed": ("1", ["--cuda-graph-impl", "local"])}


def small(a, budget: Budget, out: dict, save) -> None:
    base = SMOKE_SMALL if a.cpu_smoke else SMALL
    variants = [v for v in SMALL_VARIANTS if not (a.cpu_smoke and v == "graphed")]  # graphs need CUDA
    runs: dict[str, list[dict]] = {v: [] for v in variants}
    out["small"] = {"runs": runs}
    for round_ in range(a.rounds):
        for name in variants:
            if not budget.may_start("small", f"{name} round {round_ + 1}"):
                continue
            compiled, extra = SMALL_VARIANTS[name]
            runs[name].append(trained([*base, *extra, "--train-iters", str(2 * a.steps)], 2 * a.timed,
                                      {"TRAIN_LEDGER_COMPILE": compiled}))
            save()
            print(f"small {name} round {round_ + 1}: {runs[name][-1]['tokens_per_s']:,.0f} tokens/s", flush=True)
    best = {v: max(r["tokens_per_s"] for r in rs) for v, rs in runs.items() if rs}
    out["small"]["tokens_per_s"] = best
    if "graphed" in best:
        out["small"]["graphed_over"] = {v: best["graphed"] / best[v] for v in best if v != "graphed"}
        if runs["compiled"]:
            out["small"]["losses_equal"] = runs["graphed"][0]["losses"] == runs["compiled"][0]["losses"]
        print(f"small graphed over: {json.dumps(out['small']['graphed_over'])}; losses equal to the compiled run's: "
              f"{out['small'].get('losses_equal')}", flush=True)
    save()


def outside(out: dict, save) -> None:
    """The ledger's outside-PyTorch terms for a one-GPU dense run, now and as the engine was (a communicator for each
    of the 8 group kinds), beside what the dense runs measured."""
    h200 = DeviceOverheads.known("NVIDIA H200")
    cfg = parse_args(["--model", "llama3.2-1b", "--bf16"])
    old = parse_args(["--model", "llama3.2-1b", "--bf16"])
    old.parallel.communicators_for_groups_of_one = True
    predicted = {name: outside_pytorch(c, 0, h200).total / 2**30 for name, c in (("now", cfg), ("before", old))}
    measured = [t.get("outside_pytorch_gib") for t in out.get("dense", {}).get("table", [])]
    out["outside"] = {"predicted_gib": predicted, "measured_gib": measured}
    print(f"outside PyTorch, one H200: predicted {predicted['now']:.2f} GiB now, {predicted['before']:.2f} GiB with a "
          f"communicator per group; measured {measured}", flush=True)
    save()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--anchors", default=str(ROOT / "runs" / "bench" / "anchors"), help="folder holding mcore_anchor.py")
    p.add_argument("--out", default="engine_vii.json")
    p.add_argument("--budget-s", type=float, default=470.0, help="stop starting runs past this many seconds")
    p.add_argument("--rounds", type=int, default=2, help="dense rounds of ours and megatron-core, alternated")
    p.add_argument("--lever-rounds", type=int, default=1, help="of them, the rounds that also run the --levers")
    p.add_argument("--levers", nargs="*", default=["ours-linear-ce"], choices=["ours-linear-ce", "ours-graphed"],
                   help="our engine's variants measured beside the dense pair")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--timed", type=int, default=6)
    p.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    p.add_argument("--moe-variants", nargs="+", default=["sequential", "grouped-gemm", "mcore"],
                   choices=[*MOE_VARIANTS, "mcore"],
                   help="the moe section's runs, in this order (mcore: megatron-core's MoE, GPU only)")
    p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, no anchors: a dry run")
    a = p.parse_args()
    print("command: python " + shlex.join(sys.argv), flush=True)
    budget = Budget(a.budget_s)
    out: dict = {"command": sys.argv, "gemm_ceiling_tflops": 1.0 if a.cpu_smoke else gemm_ceiling_tflops()}
    print(f"bf16 GEMM ceiling (8192^3, random): {out['gemm_ceiling_tflops']:.0f} TFLOP/s", flush=True)

    def save() -> None:
        Path(a.out).write_text(json.dumps(out, indent=1))

    for section in a.sections:
        if section == "outside":
            outside(out, save)
        else:
            {"dense": dense, "moe": moe, "small": small}[section](a, budget, out, save)
    save()
    print(f"wrote {a.out} ({budget.left:.0f} s of the budget left)", flush=True)


if __name__ == "__main__":
    main()
