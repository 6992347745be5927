"""Is the host's pace steadier with the training process pinned to cores? One GPU.

A launch-bound step is as long as its host takes to issue it, and that pace moved 1.5-2x between runs of one shape
on one lease (BENCHMARKS.md, 2026-12-03 seventh and twentieth entries), which no start-up sweep can predict to 5%.
One suspect is the scheduler: the main thread migrating between cores, or sharing one with the process's other
threads, or a virtual machine's cores being taken by other guests (steal time). This runs one shape, `--timers`
only, unpinned and pinned (`taskset -c CORES` around torchrun, so the rank and its threads stay there), interleaved
over --repeats rounds, and prints per run the median step after the first two, its spread, and the host's steal and
context-switch counts over the run (/proc/stat), then each condition's spread across rounds.

    python3 runs/bench/host_pinning.py [--shape lb|l2] [--cores 2-5] [--train-iters 12] [--repeats 3] [--out DIR]
"""
from __future__ import annotations

import argparse
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.events import StepRecord  # noqa: E402
from common.run_dir import iter_events  # noqa: E402

COMMON = ["--bf16", "--use-distributed-optimizer", "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "1",
          "--weight-decay", "0.1", "--clip-grad", "1.0", "--mock-data", "--timers"]
# the shapes of tests/fixtures/h200_host_ranges/lb_h1024_l4_s512 and llama1b_l2_s1024: the host sets their pace
SHAPES = {"lb": ["--model", "llama3.2-1b", "--num-layers", "4", "--hidden-size", "1024", "--ffn-hidden-size", "4096",
                 "--num-attention-heads", "16", "--num-query-groups", "4", "--seq-length", "512",
                 "--max-position-embeddings", "512", "--micro-batch-size", "2", "--global-batch-size", "8"],
          "l2": ["--model", "llama3.2-1b", "--num-layers", "2", "--seq-length", "1024", "--micro-batch-size", "1",
                 "--global-batch-size", "4"]}
SKIPPED_STEPS = 2  # the first (compilation) and the second (the allocator's pools still growing)


def proc_stat() -> tuple[int, int]:
    """(steal jiffies over every CPU, context switches) since boot."""
    steal = ctxt = 0
    for line in Path("/proc/stat").read_text().splitlines():
        parts = line.split()
        if parts[0] == "cpu":
            steal = int(parts[8]) if len(parts) > 8 else 0
        elif parts[0] == "ctxt":
            ctxt = int(parts[1])
    return steal, ctxt


def step_times(run_dir: Path) -> list[float]:
    steps = sorted((e.step, e.step_time_s) for e in iter_events(run_dir, 0, {StepRecord.KIND})
                   if isinstance(e, StepRecord) and e.step_time_s)
    return [t for step, t in steps if step > SKIPPED_STEPS]


def run_once(shape: str, cores: str | None, iters: int, run_dir: Path) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1", "-m",
           "engine.train", *COMMON, *SHAPES[shape], "--train-iters", str(iters), "--run-dir", str(run_dir)]
    if cores:
        cmd = ["taskset", "-c", cores, *cmd]
    before = proc_stat()
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    after = proc_stat()
    if done.returncode != 0:
        raise SystemExit(f"host_pinning.py: {shlex.join(cmd)} failed ({done.returncode}): {done.stderr[-2000:]}")
    times = step_times(run_dir)
    return {"median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times), "max_ms": 1e3 * max(times),
            "steal": after[0] - before[0], "ctxt": after[1] - before[1]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="lb")
    ap.add_argument("--cores", default="2-5", help="taskset's core list for the pinned runs (default 2-5)")
    ap.add_argument("--train-iters", type=int, default=12)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", type=Path, default=Path("/tmp/host_pinning"))
    a = ap.parse_args(argv)
    if a.train_iters <= SKIPPED_STEPS + 2 or a.repeats < 1:
        print(f"host_pinning.py: --train-iters must exceed {SKIPPED_STEPS + 2} and --repeats be at least 1",
              file=sys.stderr)
        return 2
    if a.out.exists() and any(a.out.iterdir()):
        print(f"host_pinning.py: --out {a.out}: already holds runs; choose a new directory", file=sys.stderr)
        return 2
    medians: dict[str, list[float]] = {"unpinned": [], f"pinned {a.cores}": []}
    for round_ in range(1, a.repeats + 1):
        for name, cores in (("unpinned", None), (f"pinned {a.cores}", a.cores)):
            r = run_once(a.shape, cores, a.train_iters, a.out / f"{a.shape}_{round_}_{'pinned' if cores else 'free'}")
            medians[name].append(r["median_ms"])
            print(f"round {round_} {name:>14}: step median {r['median_ms']:.1f} ms (min {r['min_ms']:.1f}, max "
                  f"{r['max_ms']:.1f}) steal {r['steal']} jiffies, {r['ctxt']:,} context switches", flush=True)
    for name, values in medians.items():
        listed = ", ".join(f"{v:.1f}" for v in values)
        print(f"{name:>14}: medians {listed} ms; max / min {max(values) / min(values):.2f}")
    print("command: python3 " + shlex.join([sys.argv[0], *(argv if argv is not None else sys.argv[1:])]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
