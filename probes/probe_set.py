"""The one object the engine calls at its lifecycle points.

Contract with the engine (engine/training.py, the DDP buckets, the P2P communicator and the schedules call exactly
these; keep them stable):

    probes = create_probe_set(run_config, parallel_state, argv)  # collective: every rank calls it at the same point
    probes.memory_point("after_model_build")        # also "after_ddp_buffers", "after_optimizer_init", "after_first_step"
    probes.inventory(records)                       # list of dicts: name, kind, dtype, numel, bytes, padding, ... (once)
    probes.collective_sweep(parallel_state, dp_bucket_numels=[...], dp_grad_dtype=..., dp_param_dtype=...,
                            activation_numel=..., activation_dtype=...)   # collective; optional start-up sweep
    with probes.range("forward stage0 mb3", "forward", stage=0, microbatch=3, chunk=0):   # NVTX + record_function
        ...                                         # + a timer when timers are on; categories: iteration, forward,
                                                    # backward, optimizer, dp-comm, pp-comm, tp-comm
    token = probes.comm_begin("reduce-scatter bucket2", "dp-comm", bucket=2, bytes=n)   # an async collective issued
    probes.comm_end(token)                          # ... and its wait returned
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

    def collective_sweep(self, parallel_state: Any, **sizes: Any) -> None:
        pass

    def comm_begin(self, name: str, category: str, **attrs: Any) -> None:
        return None

    def comm_end(self, token: Any) -> None:
        pass

    def step_begin(self, iteration: int) -> None:
        pass

    def step_end(self, iteration: int, **figures: Any) -> None:
        pass

    def close(self, status: str = "complete", error: str | None = None) -> None:
        pass


def create_probe_set(run_config: Any, parallel_state: Any, argv: list[str]) -> NullProbeSet:
    """The engine's single entry point: a live ProbeSet when a run directory is set, else NullProbeSet."""
    return NullProbeSet()
