"""Forward-backward schedules, as Megatron Core's schedules.py: the training loop calls one function per step.

The schedule never imports DDP: it reaches the data-parallel machinery only through the callbacks on
`ScheduleConfig` (no_sync_func, grad_sync_func, param_sync_func, finalize_model_grads_func), so it runs unchanged
without DDP (tests, evaluation).

forward_step_func(data_iterator, model) -> (output_tensor, loss_func); on the last stage
loss_func(output_tensor) -> (loss, {"lm loss": detached loss}). The schedule divides the loss by the number of
micro-batches before backward so that accumulated gradients are the mean over the global batch.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from probes.probe_set import NullProbeSet


@dataclass
class ScheduleConfig:
    """Megatron's ModelParallelConfig fields that the schedules read."""
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    no_sync_func: Callable[[], Any] | None = None
    grad_sync_func: Callable[..., None] | None = None
    param_sync_func: Callable[..., None] | None = None
    finalize_model_grads_func: Callable[[list[torch.nn.Module]], None] | None = None
    probes: Any = field(default_factory=NullProbeSet)


def forward_step(forward_step_func, data_iterator, model, num_microbatches: int, config: ScheduleConfig,
                 losses: list[dict], microbatch: int, stage: int = 0, chunk: int = 0):
    with config.probes.range(f"forward stage{stage} mb{microbatch}", "forward", stage=stage, microbatch=microbatch,
                             chunk=chunk):
        output_tensor, loss_func = forward_step_func(data_iterator, model)
        if loss_func is not None:
            loss, reported = loss_func(output_tensor)
            output_tensor = loss / num_microbatches
            losses.append(reported)
    return output_tensor


def backward_step(output_tensor: torch.Tensor, output_tensor_grad: torch.Tensor | None, config: ScheduleConfig,
                  microbatch: int, stage: int = 0, chunk: int = 0) -> None:
    with config.probes.range(f"backward stage{stage} mb{microbatch}", "backward", stage=stage,
                             microbatch=microbatch, chunk=chunk):
        torch.autograd.backward(output_tensor, grad_tensors=output_tensor_grad)


def forward_backward_no_pipelining(*, forward_step_func, data_iterator, model, num_microbatches: int,
                                   config: ScheduleConfig, forward_only: bool = False, **_unused) -> list[dict]:
    """Gradient accumulation over micro-batches; DP grad sync only on the last one (no_sync for the rest)."""
    no_sync = config.no_sync_func or contextlib.nullcontext
    losses: list[dict] = []

    def one(i: int) -> None:
        out = forward_step(forward_step_func, data_iterator, model, num_microbatches, config, losses, i)
        if not forward_only:
            backward_step(out, None, config, i)

    with no_sync():
        for i in range(num_microbatches - 1):
            one(i)
    one(num_microbatches - 1)
    if config.finalize_model_grads_func is not None and not forward_only:
        config.finalize_model_grads_func([model])
    return losses


def get_forward_backward_func(pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: int | None = None):
    if pipeline_model_parallel_size == 1:
        return forward_backward_no_pipelining
    raise NotImplementedError("pipeline schedules land with Engine III")
