"""Does a hot phase slow the work after it? The time model prices a step's kernels at the power limit's factor of the
step's own compute-bound share, and the delayed expert wgrads' flush (76 ms of GEMMs back to back at the end of the
grouped MoE step) at its own (docs/formulas.md, "The power limit in a step"); yet the delayed grouped MoE runs' GEMMs
and attention ran x1.10-1.13 their isolated times, near the full-load factor, where their passes' share gives x1.05
(BENCHMARKS.md 2026-12-05). If the limiter lowers the clock fast and raises it slowly, a hot phase sets the pace of
what follows it. This measures it, with no training run.

A cycle: `hot` ms of bf16 GEMMs back to back ([8192 x 8192] x [8192 x 8192]), then `probe` ms of a smaller GEMM
([4096 x 4096] x [4096 x 4096]) each followed by a device sleep, so that the probe phase alone fills `share` of its
time with GEMMs (under the threshold: alone it is not slowed). Every probe GEMM is timed by an event pair and placed
by its start after the hot phase's end. Cycles repeat back to back (a periodic state, as training steps are); the
first `warm` are dropped. For each hot length (0: the probes alone), prints the probe GEMM's time over its isolated
time (a GEMM after a 2 ms device sleep) in windows after the hot phase, the hot GEMMs' own slowdown, and NVML's power
and SM clock over the cycles.

    python runs/bench/power_phases.py [--hot 0 20 76 150] [--probe 300] [--share 0.55] [--cycles 8] [--warm 2]
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from sustained_split import _nvml_means, _sleep_rate  # noqa: E402

from probes.compute_sweep.calls import Call  # noqa: E402
from probes.compute_sweep.harness import median_seconds  # noqa: E402
from probes.nvml import NvmlSampler  # noqa: E402

WINDOWS_MS = ((0, 10), (10, 25), (25, 50), (50, 100), (100, 200), (200, 400))


def _gemm(n: int, m: int, k: int) -> Call:
    a = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(k, m, dtype=torch.bfloat16, device="cuda")
    out = torch.empty(n, m, dtype=torch.bfloat16, device="cuda")
    return Call(lambda: torch.mm(a, b, out=out))


def _cycles(hot: Call, probe: Call, hot_n: int, probe_n: int, idle_cycles: int, cycles: int):
    """Enqueue `cycles` cycles; return per cycle (hot phase's start, end events, [(probe start, end)])."""
    def event() -> torch.cuda.Event:
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        return e
    recorded = []
    for _ in range(cycles):
        hot_start = event()
        for _ in range(hot_n):
            hot.run()
        hot_end = event()
        probes = []
        for _ in range(probe_n):
            start = event()
            probe.run()
            probes.append((start, event()))
            torch.cuda._sleep(idle_cycles)
        recorded.append((hot_start, hot_end, probes))
    return recorded


def measure(hot_ms: float, args: argparse.Namespace, hot: Call, probe: Call, iso_hot: float, iso_probe: float,
            per_cycle: float, nvml: NvmlSampler) -> str:
    idle_cycles = int(iso_probe * (1 - args.share) / args.share / per_cycle)
    hot_n = round(hot_ms / 1e3 / iso_hot)
    probe_n = round(args.probe / 1e3 / (iso_probe / args.share))
    _cycles(hot, probe, hot_n, probe_n, idle_cycles, args.warm)
    torch.cuda.synchronize()
    nvml.drain()
    recorded = _cycles(hot, probe, hot_n, probe_n, idle_cycles, args.cycles)
    torch.cuda.synchronize()
    samples = nvml.drain()
    by_window: dict[tuple[int, int], list[float]] = {w: [] for w in WINDOWS_MS}
    hot_ratio, shares = [], []
    for hot_start, hot_end, probes in recorded:
        if hot_n:
            hot_ratio.append(hot_start.elapsed_time(hot_end) / 1e3 / hot_n / iso_hot)
        busy = 0.0
        for start, end in probes:
            after_ms = hot_end.elapsed_time(start)
            seconds = start.elapsed_time(end) / 1e3
            busy += seconds
            for lo, hi in WINDOWS_MS:
                if lo <= after_ms < hi:
                    by_window[(lo, hi)].append(seconds / iso_probe)
        span = hot_end.elapsed_time(probes[-1][1]) / 1e3
        shares.append(busy / span)
    cells = [f"x{statistics.median(v):.3f}" if v else "—" for v in by_window.values()]
    hot_cell = f"x{statistics.median(hot_ratio):.3f}" if hot_ratio else "—"
    return (f"| {hot_ms:g} | {hot_cell} | {statistics.median(shares):.2f} | " + " | ".join(cells)
            + f" | {_nvml_means(samples)} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hot", type=float, nargs="+", default=[0, 20, 76, 150], help="hot phase lengths, ms")
    ap.add_argument("--probe", type=float, default=300.0, help="the probe phase's length, ms")
    ap.add_argument("--share", type=float, default=0.55, help="the probe phase's GEMM share of its time")
    ap.add_argument("--cycles", type=int, default=8)
    ap.add_argument("--warm", type=int, default=2)
    args = ap.parse_args()
    bad = [f"--hot {h:g}" for h in args.hot if not 0 <= h <= 2000]
    bad += [] if 1 <= args.probe <= 2000 else [f"--probe {args.probe:g}"]
    bad += [] if 0.05 <= args.share <= 1 else [f"--share {args.share:g}"]
    bad += [] if 1 <= args.cycles <= 100 and 0 <= args.warm <= 100 else ["--cycles / --warm"]
    if bad:
        print(f"power_phases.py: out of range: {', '.join(bad)}", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("power_phases.py: needs a CUDA device", file=sys.stderr)
        return 2
    hot, probe = _gemm(8192, 8192, 8192), _gemm(4096, 4096, 4096)
    iso_hot, iso_probe = (median_seconds(op, 3, 20, True) for op in (hot, probe))
    per_cycle = _sleep_rate()
    nvml = NvmlSampler(0.01)
    print(f"NVML: {nvml.status}; {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"isolated: hot GEMM {iso_hot * 1e3:.3f} ms, probe GEMM {iso_probe * 1e3:.3f} ms; probe phase {args.probe:g} "
          f"ms at share {args.share:g}; {args.cycles} cycles after {args.warm}")
    windows = " | ".join(f"probe {lo}-{hi} ms after" for lo, hi in WINDOWS_MS)
    print(f"| hot ms | hot GEMM / isolated | probe phase share | {windows} | power, clock |")
    print("|---" * (4 + len(WINDOWS_MS)) + "|")
    for hot_ms in args.hot:
        print(measure(hot_ms, args, hot, probe, iso_hot, iso_probe, per_cycle, nvml), flush=True)
    print("command: python3 runs/bench/power_phases.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
