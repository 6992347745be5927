"""Collectives into and out of the tensor-parallel region, one autograd.Function each, as Megatron's mappings.py.

Each forward collective has a conjugate backward, so that autograd moves gradients the opposite way:

    copy_to_tensor_model_parallel_region         identity          | all-reduce
    reduce_from_tensor_model_parallel_region     all-reduce        | identity
    scatter_to_tensor_model_parallel_region      split last dim   | all-gather last dim
    gather_from_tensor_model_parallel_region     all-gather last  | split last dim
    reduce_scatter_to_sequence_parallel_region   reduce-scatter 0 | all-gather dim 0

Activations are [s, b, h] (sequence first), so the sequence-parallel collectives work on dim 0, which keeps every
shard contiguous and needs no copy around the collective. Each collective runs inside a probes range of category
"tp-comm"; with TP size 1 every mapping is the identity and issues nothing.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.parallel_state import GroupView
from probes.protocol import ProbeSetProtocol

# torch 2.13 renamed the single-tensor collectives; older builds (a GPU box may have one) only know the old names.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass(frozen=True)
class TPGroup(GroupView):
    """The tensor-parallel group as the layers need it (a GroupView of "tp")."""

    @classmethod
    def from_parallel_state(cls, parallel_state: Any, probes: ProbeSetProtocol | None = None) -> "TPGroup":
        return cls.of(parallel_state, "tp", probes)


def _all_reduce(x: torch.Tensor, tp: TPGroup, name: str) -> torch.Tensor:
    x = x.contiguous()
    with tp.probes.range(name, "tp-comm", bytes=x.numel() * x.element_size()):
        dist.all_reduce(x, group=tp.group)
    return x


def _all_gather(x: torch.Tensor, tp: TPGroup, dim: int, name: str) -> torch.Tensor:
    """Concatenate every rank's x along dim; dim 0 gathers in place into the output, other dims need one copy."""
    moved = x.movedim(dim, 0).contiguous() if dim != 0 else x.contiguous()
    out = moved.new_empty((moved.shape[0] * tp.size, *moved.shape[1:]))
    with tp.probes.range(name, "tp-comm", bytes=out.numel() * out.element_size()):
        _all_gather_single(out, moved, group=tp.group)
    return out.movedim(0, dim).contiguous() if dim != 0 else out


def _reduce_scatter_dim0(x: torch.Tensor, tp: TPGroup, name: str) -> torch.Tensor:
    x = x.contiguous()
    if x.shape[0] % tp.size:
        raise ValueError(f"{name}: dim 0 ({x.shape[0]}) is not divisible by the TP size {tp.size}")
    out = x.new_empty((x.shape[0] // tp.size, *x.shape[1:]))
    with tp.probes.range(name, "tp-comm", bytes=x.numel() * x.element_size()):
        _reduce_scatter_single(out, x, group=tp.group)
    return out


def _split(x: torch.Tensor, tp: TPGroup, dim: int) -> torch.Tensor:
    """This rank's contiguous slice of x along dim (no communication)."""
    if x.shape[dim] % tp.size:
        raise ValueError(f"dim {dim} ({x.shape[dim]}) is not divisible by the TP size {tp.size}")
    return x.chunk(tp.size, dim=dim)[tp.rank].contiguous()


class _CopyToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return x

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.tp, "tp all-reduce (copy bwd)"), None


class _ReduceFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        # In place, as Megatron: x is a fresh partial sum (a GEMM output) that nothing else holds.
        return _all_reduce(x, tp, "tp all-reduce")

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _split(x, tp, -1)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.tp, -1, "tp all-gather (scatter bwd)"), None


class _GatherFromModelParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _all_gather(x, tp, -1, "tp all-gather")

    @staticmethod
    def backward(ctx, grad):
        return _split(grad, ctx.tp, -1), None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, tp):
        ctx.tp = tp
        return _reduce_scatter_dim0(x, tp, "sp reduce-scatter")

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.tp, 0, "sp all-gather (reduce-scatter bwd)"), None


def copy_to_tensor_model_parallel_region(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _CopyToModelParallelRegion.apply(x, tp)


def reduce_from_tensor_model_parallel_region(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _ReduceFromModelParallelRegion.apply(x, tp)


def scatter_to_tensor_model_parallel_region(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _ScatterToModelParallelRegion.apply(x, tp)


def gather_from_tensor_model_parallel_region(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _GatherFromModelParallelRegion.apply(x, tp)


def reduce_scatter_to_sequence_parallel_region(x: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    return x if tp.size == 1 else _ReduceScatterToSequenceParallelRegion.apply(x, tp)
