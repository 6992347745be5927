"""Does the host issue a pass slower while the device is busy? The start-up pass timer (engine/probe_adapters.py)
drains the device before each pass; a training step issues its passes while the device still runs the last ones,
and issues them ~1.3x slower (BENCHMARKS.md, 2026-12-02 fourteenth and 2026-12-03 fifteenth entries).

    python runs/bench/busy_device_issue.py [--layers 48] [--width 1024] [--rows 512] [--repeats 30]

A stack of `--layers` bf16 linear + GELU layers on [rows, width] (a launch-bound pass: small kernels), its forward and
backward issue timed on the host (perf_counter) after the device is left: idle (synchronised), busy with one long
kernel (torch.cuda._sleep, ~40 ms), or busy with a queue of 500 adds (~20 ms, short of filling the launch queue),
the median of `--repeats` each, modes interleaved. Prints a table and the command. Needs CUDA.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

QUEUED = 500  # adds of 64 MB each: ~20 ms of device, well under the launch queue's ~1,000 entries
MODES = ("idle", "one long kernel", "queued small kernels")


def stack(layers: int, width: int) -> torch.nn.Module:
    blocks = [m for _ in range(layers) for m in (torch.nn.Linear(width, width), torch.nn.GELU())]
    return torch.nn.Sequential(*blocks).cuda().to(torch.bfloat16)


def occupy(mode: str, filler: torch.Tensor, cycles: int) -> None:
    """Leave the device busy for 20-40 ms in `mode` (idle: drained)."""
    torch.cuda.synchronize()
    if mode == "one long kernel":
        torch.cuda._sleep(cycles)
    elif mode == "queued small kernels":
        for _ in range(QUEUED):
            filler.add_(1.0)


def issue(model: torch.nn.Module, x: torch.Tensor) -> tuple[float, float]:
    """(forward, backward) host seconds to issue one pass."""
    start = time.perf_counter()
    loss = model(x).float().sum()
    middle = time.perf_counter()
    loss.backward()
    return middle - start, time.perf_counter() - middle


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=48)
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--rows", type=int, default=512)
    p.add_argument("--repeats", type=int, default=30)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("busy_device_issue: needs CUDA", file=sys.stderr)
        return 2
    model, x = stack(a.layers, a.width), torch.randn(a.rows, a.width, device="cuda", dtype=torch.bfloat16)
    filler = torch.zeros(16 * 1024 * 1024, device="cuda")
    cycles = int(torch.cuda.get_device_properties(0).clock_rate * 1e3 * 0.040)  # clock_rate in kHz
    for mode in MODES:  # warm-up
        occupy(mode, filler, cycles)
        issue(model, x)
    times: dict[str, list[tuple[float, float]]] = {m: [] for m in MODES}
    for _ in range(a.repeats):
        for mode in MODES:
            occupy(mode, filler, cycles)
            times[mode].append(issue(model, x))
            model.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    idle_f, idle_b = (statistics.median(t[i] for t in times["idle"]) for i in (0, 1))
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}: {a.layers} layers of [{a.rows}, {a.width}]")
    print("| device during the issue | forward | backward | forward / idle | backward / idle |")
    print("|---|---|---|---|---|")
    for mode in MODES:
        f, b = (statistics.median(t[i] for t in times[mode]) for i in (0, 1))
        print(f"| {mode} | {f * 1e3:.3f} ms | {b * 1e3:.3f} ms | {f / idle_f:.2f}x | {b / idle_b:.2f}x |")
    print("command: python3 runs/bench/busy_device_issue.py " + " ".join(argv if argv is not None else sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
