"""Time and peak RSS of `train-ledger reconcile` and `export-trace` on a synthetic 8-rank run (TP2 x PP2 x DP2)
with 2 profiled steps per rank, each command in its own process so its peak RSS is its own.

    python runs/bench/reconcile_bench.py [--kernels-per-step 100000] [--keep DIR]

The traces are the test fixtures' (tests/fixtures/synthetic_run.py) padded with filler kernels to a realistic size;
the figure to watch is peak RSS against the largest single trace (uncompressed): the ledger promises a small
multiple of one trace, not the sum of all eight.
"""
from __future__ import annotations

import argparse
import gzip
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def peak_rss_mib() -> float:
    """This process's high-water RSS. Not getrusage's ru_maxrss: Linux carries that over fork + exec, so a child of
    a big parent would report the parent's peak."""
    with open("/proc/self/status", encoding="ascii") as f:
        line = next(row for row in f if row.startswith("VmHWM:"))
    return int(line.split()[1]) / 1024


def child(argv: list[str]) -> None:
    """Run one CLI command in this process and print its wall time and peak RSS."""
    from cli.main import main

    start = time.perf_counter()
    rc = main(argv)
    wall = time.perf_counter() - start
    peak = peak_rss_mib()
    print(f"{wall:.2f} {peak:.1f} {rc}")


def measure(argv: list[str]) -> tuple[float, float]:
    done = subprocess.run([sys.executable, __file__, "--child", *argv], capture_output=True, text=True, cwd=REPO,
                          check=True)
    wall, peak, rc = done.stdout.split()[-3:]
    if rc != "0":
        raise SystemExit(f"{' '.join(argv)} exited {rc}: {done.stderr[-2000:]}")
    return float(wall), float(peak)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--kernels-per-step", type=int, default=100_000)
    p.add_argument("--keep", type=Path, help="build the run here and keep it")
    p.add_argument("--child", nargs=argparse.REMAINDER)
    a = p.parse_args()
    if a.child is not None:
        child(a.child)
        return
    sys.path.insert(0, str(REPO))
    from tests.fixtures.synthetic_run import Spec, make_run

    root = a.keep or Path(tempfile.mkdtemp(prefix="reconcile-bench-"))
    start = time.perf_counter()
    run, _ = make_run(root / "run", Spec(tp=2, pp=2, dp=2, steps=2, extra_kernels=a.kernels_per_step))
    built = time.perf_counter() - start
    traces = sorted((run / "traces").glob("*.json.gz"))
    sizes = [len(gzip.decompress(t.read_bytes())) / 2**20 for t in traces]
    rec_wall, rec_rss = measure(["reconcile", str(run)])
    exp_wall, exp_rss = measure(["export-trace", str(run), "--out", str(root / "merged.json.gz")])
    print(f"command: python runs/bench/reconcile_bench.py --kernels-per-step {a.kernels_per_step}")
    print(f"run: 8 ranks (tp2 pp2 dp2), 2 profiled steps, {len(traces)} traces, uncompressed {sum(sizes):.1f} MiB in "
          f"all, largest {max(sizes):.1f} MiB (built in {built:.1f} s)")
    for name, wall, rss in (("reconcile", rec_wall, rec_rss), ("export-trace", exp_wall, exp_rss)):
        print(f"{name + ':':<14}{wall:6.2f} s  peak RSS {rss:7.1f} MiB = {rss / max(sizes):.1f} x the largest trace, "
              f"{rss / sum(sizes):.2f} x all traces")


if __name__ == "__main__":
    main()
