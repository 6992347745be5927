"""What the engine may call on its probes: the one interface that the live ProbeSet and the disabled NullProbeSet
(probes.probe_set) both provide, so that every engine signature names it instead of `Any`.

The calls, in the engine's order (engine/training.py, the DDP buckets, the P2P communicator, the schedules, the
data loaders and the checkpointer make exactly these; keep them stable):

    probes.memory_point("after_model_build", held)  # also "after_ddp_buffers", "after_optimizer_init",
                                                    # "after_first_step"; held: () -> the engine's tensors (params,
                                                    # grad buffers, optimizer state), sized by storage on CPU
                                                    # (probes.memory.tensor_census)
    probes.inventory(records)                       # once: dicts of name, kind, dtype, numel, bytes, padding, ...
    probes.collective_sweep(parallel_state, dp_bucket_numels=[...], dp_grad_dtype=..., dp_param_dtype=...,
                            activation_numel=..., activation_dtype=..., expert_bucket_numels=[...],
                            ep_dispatch_numel=..., cp_message_numels=[...])  # collective; optional start-up sweep
                                                    # (probes.bandwidth.SweepSizes)
    probes.compute_sweep(run_config, first_stage=..., last_stage=...,
                         optimizer_numel=..., grad_buffer_numel=..., kernels=EngineKernels(...))  # optional, start-up
    probes.host_sweep()                             # optional, start-up: the host's cost per kind of call
    with probes.range("forward stage0 mb3", "forward", stage=0, microbatch=3, chunk=0):   # NVTX + record_function
        ...                                         # + a timer when timers are on; categories: iteration, forward,
                                                    # backward, optimizer, dp-comm, pp-comm, tp-comm,
                                                    # embd-comm (tied embeddings' grad all-reduce),
                                                    # dp-wait (a stall: "wait ..." names, e.g. the DDP
                                                    # pre-hook's all-gather wait nested in a forward),
                                                    # checkpoint (a save or load, between steps),
                                                    # data-wait (a stall: next() waiting on the data loader's queue,
                                                    # "wait data mbN" nested in a forward; engine.data),
                                                    # cp-comm, cp-wait, ep-comm (common.events.RANGE_CATEGORIES)
    work, token = probes.comm_issue("reduce-scatter bucket2", "dp-comm", issue, bucket=2, bytes=n)  # issue(): the
                                                    # async collective, issued inside a record_function of the range
    probes.comm_end(token)                          # ... and its wait returned
    probes.step_begin(iteration)
    probes.step_end(iteration, loss=..., lr=..., grad_norm=..., tokens=..., step_time_s=...)
    probes.checkpoint("save", iteration=n, path=..., bytes=..., blocking_seconds=..., background_seconds=...,
                      write_seconds=..., async_save=..., loaded_iteration=...)          # and the blocking parts
    probes.checkpoint("load", iteration=n, path=..., finetune=..., seconds=...)   # engine.checkpointing, per rank
    probes.close(status="complete" | "failed", error=None)

`enabled` says which of the two an object is (True: a live ProbeSet writing a run directory).
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any, Callable, Iterable, Protocol, runtime_checkable

import torch

from common.config import RunConfig
from probes.compute_sweep import EngineKernels


@runtime_checkable
class ProbeSetProtocol(Protocol):
    enabled: bool

    def memory_point(self, name: str, held: Callable[[], Iterable[torch.Tensor]] | None = None) -> None: ...

    def inventory(self, records: list[dict[str, Any]]) -> None: ...

    def range(self, name: str, category: str, **attrs: Any) -> AbstractContextManager[None]: ...

    def comm_issue(self, name: str, category: str, issue: Callable[[], Any], **attrs: Any) -> tuple[Any, Any]:
        """Runs `issue()` (an async collective) in the range; returns its work handle and the token comm_end takes."""

    def comm_end(self, token: Any) -> None: ...

    def collective_sweep(self, parallel_state: Any, **sizes: Any) -> None:
        """Collective; sizes: the fields of probes.bandwidth.SweepSizes."""

    def compute_sweep(self, run_config: RunConfig, *, first_stage: bool, last_stage: bool, optimizer_numel: int,
                      grad_buffer_numel: int, kernels: EngineKernels) -> None: ...

    def host_sweep(self, passes: Callable[[], dict[str, float]] | None = None) -> None: ...

    def checkpoint(self, action: str, **fields: Any) -> None: ...

    def step_begin(self, iteration: int) -> None: ...

    def step_end(self, iteration: int, **figures: Any) -> None: ...

    def close(self, status: str = "complete", error: str | None = None) -> None: ...
