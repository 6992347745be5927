"""The timing harness: `warmup` calls, then `iters` timed ones, the median kept; a backward's forward (Op.setup)
runs untimed before each call. On GPU CUDA events bracket the op alone, after a device sleep long enough for the host
to enqueue all of it: so the figure is the device's time, as in a training step where the host runs ahead of the
device (a run so small that the host cannot keep up runs slower than predicted). On CPU perf_counter."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from probes.compute_sweep.calls import Op

# GPU cycles (about 2 ms at 2 GHz) the device sleeps before each timed call, so that the host has enqueued the whole
# op before the start event fires: the events then time the device's work, not the host's launch overhead.
HOST_AHEAD_CYCLES = 4_000_000


def median_seconds(op: Op, warmup: int, iters: int, cuda: bool, before: Callable[[], None] | None = None) -> float:
    """`before` runs ahead of each timed call, untimed (runs/bench/l2_state.py: evicting the L2 cache)."""
    for _ in range(warmup):
        op.setup()
        op.run()
    marks = []
    for _ in range(iters):
        op.setup()
        if before is not None:
            before()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(HOST_AHEAD_CYCLES)
            start.record()
            op.run()
            end.record()
            marks.append((start, end))
        else:
            t0 = time.perf_counter()
            op.run()
            marks.append(time.perf_counter() - t0)
    if cuda:
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) / 1e3 for start, end in marks)
    return statistics.median(marks)
