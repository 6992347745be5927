"""Which kernels does the power limit slow? The sweep's sustained.layer record times a layer's kernels back to back
and books the whole slowdown on the compute-bound ones (calibration.py); the committed H200 steps show their GEMMs
slowed less than that factor and their other kernels more (BENCHMARKS.md, 2026-12-03 fifth and 2026-12-04 twelfth).
This times the same record's kernels one by one inside the loop (an event pair around each op), so each class's
slowdown is measured rather than inferred, at duty cycles below one too (a device sleep after each pass: a step's
idle), with NVML's power and SM clock sampled meanwhile. No training run is involved.

    python runs/bench/sustained_split.py [--shapes llama3.2-1b:4096 ...] [--duty 1.0 0.85 0.7 0.5] [--seconds 1.0]

Prints, per shape and duty cycle: the pass's seconds, each class's in-loop seconds against its isolated ones (the
sweep's harness), the factor the sweep would infer, mean power and SM clock; then the command.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hardware_sweep import MODELS, _spec  # noqa: E402

from engine.probe_adapters import engine_kernels  # noqa: E402
from ledger.models.simulate.fit import slowdown_line  # noqa: E402
from probes import compute_sweep  # noqa: E402
from probes.compute_sweep.calls import Call  # noqa: E402
from probes.compute_sweep.harness import median_seconds  # noqa: E402
from probes.compute_sweep.sustained import _back_to_back, timed_passes  # noqa: E402
from probes.nvml import NvmlSampler  # noqa: E402


def _sleep_rate() -> float:
    """Seconds per cycle of torch.cuda._sleep, timed on an idle device."""
    cycles = 20_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / cycles


def _per_op(ops: list, idle_cycles: int, seconds: float) -> list[float]:
    """Each op's mean device seconds inside back-to-back passes for `seconds` (an event before each op, one after the
    last), the host at most a few passes ahead."""
    sums = [0.0] * len(ops)
    passes = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        marks = []
        for _ in range(5):
            events = [torch.cuda.Event(enable_timing=True) for _ in range(len(ops) + 1)]
            for op, event in zip(ops, events):
                event.record()
                op.run()
            events[-1].record()
            if idle_cycles:
                torch.cuda._sleep(idle_cycles)
            marks.append(events)
        marks[-1][-1].synchronize()
        for events in marks:
            for i in range(len(ops)):
                sums[i] += events[i].elapsed_time(events[i + 1]) / 1e3
        passes += 5
    return [s / passes for s in sums]


def threshold_share(points: list[tuple[float, float]]) -> float | None:
    """Where the line through the (compute-bound share, slowdown) points clearly above 1 (over 1.02: the GPU at its
    limit) reaches 1: the share below which the GPU stays under its power limit. None with fewer than two."""
    above = [(x, y) for x, y in points if y > 1.02]
    return slowdown_line(above)[0] if len({x for x, _ in above}) >= 2 else None


def _nvml_means(samples: list[dict]) -> str:
    if not samples:
        return "no NVML samples"
    power = statistics.mean(s["power_w"] for s in samples)
    clocks = sorted(s["sm_clock_mhz"] for s in samples)
    return f"{power:.0f} W, SM {clocks[0]}-{clocks[-1]} MHz (median {clocks[len(clocks) // 2]})"


def measure(label: str, seq: int, duties: list[float], seconds: float, nvml: NvmlSampler) -> float | None:
    device = torch.device("cuda")
    h, f, heads, kv, vocab, _ = next(m[1:] for m in MODELS if m[0] == label)
    spec = _spec(h, f, heads, kv, vocab, 1, seq)
    planned = [p for p in compute_sweep.plan(spec, device, engine_kernels([], vocab, device)) if p.sustained]
    ops = [p.build() for p in planned]
    compute = [p.flops > 0 for p in planned]
    isolated = [median_seconds(op, 3, 10, True) for op in ops]
    iso_c = sum(s for s, c in zip(isolated, compute) if c)
    iso_m = sum(isolated) - iso_c
    per_cycle = _sleep_rate()
    print(f"## {label} seq {seq}: {len(ops)} kernels; isolated compute-bound {iso_c * 1e3:.3f} ms, "
          f"memory-bound {iso_m * 1e3:.3f} ms")
    print("| duty | pass ms | compute-bound in loop / isolated | memory-bound in loop / isolated | "
          "sweep's inferred factor | power, clock (whole-pass record) |")
    print("|---|---|---|---|---|---|")
    points = []
    for duty in duties:
        idle_cycles = int(sum(isolated) * (1 - duty) / duty / per_cycle) if duty < 1 else 0

        def one_pass() -> None:
            for op in ops:
                op.run()
            if idle_cycles:
                torch.cuda._sleep(idle_cycles)

        _back_to_back(one_pass, 1.5)
        nvml.drain()
        pass_s = timed_passes(one_pass, seconds)[0]
        samples = nvml.drain()
        in_loop = _per_op(ops, idle_cycles, seconds)
        loop_c = sum(s for s, c in zip(in_loop, compute) if c)
        loop_m = sum(in_loop) - loop_c
        inferred = (sum(in_loop) - iso_m) / iso_c
        points.append((loop_c / pass_s, loop_c / iso_c))
        print(f"| {duty:.2f} | {pass_s * 1e3:.3f} | {loop_c * 1e3:.3f} / {iso_c * 1e3:.3f} = x{loop_c / iso_c:.3f} | "
              f"{loop_m * 1e3:.3f} / {iso_m * 1e3:.3f} = x{loop_m / iso_m:.3f} | x{inferred:.3f} | "
              f"{_nvml_means(samples)} |")
    torch.cuda.synchronize()
    after = [median_seconds(op, 3, 10, True) for op in ops]
    print(f"isolated again after the loops: compute-bound {sum(s for s, c in zip(after, compute) if c) * 1e3:.3f} ms, "
          f"memory-bound {sum(s for s, c in zip(after, compute) if not c) * 1e3:.3f} ms")
    print("per kernel (isolated / in the last loop, us):", "; ".join(
        f"{p.op} {a * 1e6:.0f}/{b * 1e6:.0f}" for p, a, b in zip(planned, isolated, in_loop)))
    found = threshold_share(points)
    print("(compute-bound share of the pass, slowdown):", ", ".join(f"({x:.3f}, {y:.3f})" for x, y in points),
          f"-> threshold share {found:.3f}" if found is not None else "-> no threshold (under two points at the limit)")
    return found


def memory_power(label: str, seq: int, seconds: float, nvml: NvmlSampler) -> None:
    """Power and clock of loops that are not the compute-bound kernels: the device sleeping (idle draw), an HBM copy,
    torch's fused AdamW over 256 M fp32 parameters, and the layer's own memory-bound kernels back to back; each with
    its slowdown over its isolated time. Does memory-bound work count toward the power limit, and by how much?"""
    device = torch.device("cuda")
    h, f, heads, kv, vocab, _ = next(m[1:] for m in MODELS if m[0] == label)
    planned = [p for p in compute_sweep.plan(_spec(h, f, heads, kv, vocab, 1, seq), device,
                                             engine_kernels([], vocab, device)) if p.sustained and p.flops == 0]
    layer = [p.build() for p in planned]
    src = torch.empty(1 << 29, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    params = [torch.zeros(1 << 26, device=device, requires_grad=True) for _ in range(4)]
    for p in params:
        p.grad = torch.zeros_like(p)
    adam = torch.optim.AdamW(params, lr=1e-4, fused=True)
    loops = {"sleep (idle draw)": lambda: torch.cuda._sleep(1_000_000), "copy 1 GiB": lambda: dst.copy_(src),
             "fused AdamW, 256 M params": adam.step,
             f"{label} seq {seq}'s memory-bound layer kernels": lambda: [op.run() for op in layer]}
    print(f"## memory-bound loops ({label} seq {seq})")
    print("| loop | pass ms (isolated) | pass ms back to back | slowdown | power, clock |")
    print("|---|---|---|---|---|")
    for name, fn in loops.items():
        alone = median_seconds(Call(fn), 3, 10, True)
        _back_to_back(fn, 1.0)
        nvml.drain()
        loaded = timed_passes(fn, seconds)[0]
        print(f"| {name} | {alone * 1e3:.3f} | {loaded * 1e3:.3f} | x{loaded / alone:.3f} | "
              f"{_nvml_means(nvml.drain())} |")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", nargs="+", default=["llama3.2-1b:4096", "llama3.1-8b:4096", "llama3.2-1b:1024"])
    parser.add_argument("--duty", nargs="+", type=float, default=[1.0, 0.85, 0.7, 0.5])
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--memory-loops", action="store_true",
                        help="also the memory-bound loops' power (memory_power), at the first shape")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("sustained_split.py: needs a CUDA device", file=sys.stderr)
        return 2
    nvml = NvmlSampler(0.05)
    print(f"NVML: {nvml.status}; {torch.cuda.get_device_name()}, torch {torch.__version__}")
    found = {}
    for shape in args.shapes:
        label, _, seq = shape.partition(":")
        found[shape] = measure(label, int(seq), args.duty, args.seconds, nvml)
        torch.cuda.empty_cache()
    if args.memory_loops:
        label, _, seq = args.shapes[0].partition(":")
        memory_power(label, int(seq), 2 * args.seconds, nvml)
    long = [t for shape, t in found.items() if t is not None and int(shape.partition(":")[2]) >= 4096]
    if long:  # short shapes' kernels are too brief for an event pair each: their in-loop times carry the events' gaps
        print(f"threshold share, mean over the shapes at seq >= 4096: {statistics.mean(long):.3f}")
    nvml.stop()
    print("command: python3 runs/bench/sustained_split.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
