"""Issue 10's 2-rank layouts on the CPU (gloo), each reconciled and reported:

  dp2  DP=2, distributed optimizer, overlapped grad reduce-scatter and param all-gather (small buckets, so that
       several buckets overlap the backward)
  tp2  TP=2 with sequence parallelism
  pp2  PP=2 with the 1F1B schedule, 8 micro-batches (analytic bubble 1/9)

each on the `tiny` model with every probe on (--all-probes) and the profiler window on steps 2-3 of both ranks; then
the ledger's reconcile and report in this process, and the headline rows `train-ledger demo` prints. The GPU
counterparts (llama3.2-1b at seq 4096 on two H200s, NCCL) are the other half of issue 10.

    usage: python runs/engine/cpu_layouts.py [--out DIR] [--train-iters N] [LAYOUT ...]
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

COMMON = ["--model", "tiny", "--micro-batch-size", "1", "--lr", "3e-3", "--min-lr", "3e-4", "--mock-data",
          "--all-probes", "--use-pytorch-profiler", "--profile-step-start", "2", "--profile-step-end", "3",
          "--profile-ranks", "0", "1"]
LAYOUTS: dict[str, list[str]] = {
    "dp2": ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
            "--ddp-bucket-size", "40000", "--global-batch-size", "16"],
    "tp2": ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--global-batch-size", "8"],
    "pp2": ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"],
}


def run_layout(name: str, run_dir: Path, train_iters: int) -> int:
    from cli import train
    from cli.demo import print_headline
    from ledger.present import report
    from ledger.reconcile.run import reconcile, write

    print(f"== {name}: {' '.join(LAYOUTS[name])} -> {run_dir}", flush=True)
    status = train.main(["--nproc-per-node", "2", *COMMON, *LAYOUTS[name], "--train-iters", str(train_iters),
                         "--run-dir", str(run_dir)])
    if status != 0:
        print(f"== {name}: training failed (exit status {status})", flush=True)
        return status
    result = reconcile(run_dir)
    write(result)
    report.write(str(run_dir))
    print_headline(result)
    return 0


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("layouts", nargs="*", metavar="LAYOUT", help=f"any of {', '.join(LAYOUTS)} (default: all)")
    p.add_argument("--out", type=Path, default=Path("runs/out") / f"cpu-layouts-{time.strftime('%Y%m%d-%H%M%S')}")
    p.add_argument("--train-iters", type=int, default=4)
    a = p.parse_args(argv)
    unknown = [name for name in a.layouts if name not in LAYOUTS]
    if unknown:
        p.error(f"unknown layout {unknown[0]!r} (one of: {', '.join(LAYOUTS)})")
    failed = [name for name in a.layouts or LAYOUTS if run_layout(name, a.out / name, a.train_iters) != 0]
    print(f"runs under {a.out}" + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
