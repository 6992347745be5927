"""The clock a GPU computes at in a step: under continuous load it sits at its power limit, at lower clocks than the
isolated timings see (an H200: ~1.98 GHz alone, ~1.5-1.7 GHz at 690 W in training), which slows every kernel about
alike (runs/bench/sustained_split.py times them one by one inside this loop). The sweep measures it on the model's
own mix (the catalogue's LayerOps.sustained: a layer's directly callable kernels) back to back for
SUSTAINED_WARMUP_S, then timed for SUSTAINED_TIMED_S: the "sustained.layer" record (`seconds` per pass), beside the
same kernels' isolated sums split into compute-bound (the kernels that count FLOPs: `compute_bound_s`) and
memory-bound (`memory_bound_s`); the time model scales a step's kernels by the slowdown, as much of it as the step's
compute-bound share reaches (ledger/models/time_model/calibration.py, PowerLimit)."""
from __future__ import annotations

import time
from typing import Any, Callable

import torch

from common.ops import SUSTAINED
from probes.compute_sweep.planned import Planned

SUSTAINED_WARMUP_S, SUSTAINED_TIMED_S = 0.75, 1.0


def _back_to_back(one_pass: Callable[[], None], seconds: float) -> int:
    """Enqueue passes for `seconds` of host time, the host kept at most two blocks of ten ahead of the device (an
    event per block) so that the device never idles and the queue stays short; returns the passes enqueued."""
    passes, previous = 0, None
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            one_pass()
        passes += 10
        mark = torch.cuda.Event()
        mark.record()
        if previous is not None:
            previous.synchronize()
        previous = mark
    return passes


def timed_passes(one_pass: Callable[[], None], seconds: float) -> tuple[float, int]:
    """(device seconds per pass, passes) of passes enqueued back to back for `seconds` of host time, timed by an event
    pair around them all."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    passes = _back_to_back(one_pass, seconds)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / passes, passes


def sustained_layer(planned: list[Planned], isolated: list[float]) -> dict[str, Any]:
    """A layer's directly callable kernels (no autograd setup between them; an MoE layer's experts once per row
    count) back to back on the GPU until it sits at its power limit, then timed: seconds per pass, beside the same
    kernels' isolated sums by kind (`isolated`: each planned op's seconds, in order)."""
    chosen = [(p, seconds) for p, seconds in zip(planned, isolated) if p.sustained]
    layer = [p for p, _ in chosen]
    ops = [p.build() for p in layer]

    def one_pass() -> None:
        for op in ops:
            op.run()

    _back_to_back(one_pass, SUSTAINED_WARMUP_S)
    per_pass, passes = timed_passes(one_pass, SUSTAINED_TIMED_S)
    compute = sum(seconds for p, seconds in chosen if p.flops > 0)
    return {"op": SUSTAINED, "dims": {"kernels": len(layer)}, "dtype": layer[0].dtype,
            "seconds": per_pass, "flops": sum(p.flops for p in layer),
            "compute_bound_s": compute, "memory_bound_s": sum(seconds for _, seconds in chosen) - compute,
            "iters": passes}
