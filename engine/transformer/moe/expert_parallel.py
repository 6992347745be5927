"""The expert-parallel group as the MoE layer needs it, and its all-to-all as an autograd Function.

An all-to-all with split sizes (dist.all_to_all_single) sends rows [input_splits[0]] to EP rank 0, the next
[input_splits[1]] to rank 1, and so on, and receives output_splits[j] rows from rank j. Its conjugate is the same
exchange with the splits swapped, so the backward of a dispatch is an all-to-all of the gradient the other way.
Every exchange runs in a probes range of category "ep-comm" (team sheet: bytes = the input buffer, this rank's own
share included, as nccl-tests' "size"; remote_bytes = what leaves the rank; layer; phase). With EP size 1 nothing
here is called: the dispatcher permutes locally.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from engine.parallel_state import GroupView
from probes.protocol import ProbeSetProtocol


@dataclass(frozen=True)
class EPGroup(GroupView):
    """The expert-parallel group as the MoE layer needs it (a GroupView of "ep"); built once per model."""

    @classmethod
    def from_parallel_state(cls, parallel_state: Any, probes: ProbeSetProtocol | None = None) -> "EPGroup":
        return cls.of(parallel_state, "ep", probes)


def _exchange(x: torch.Tensor, ep: EPGroup, output_splits: list[int], input_splits: list[int], name: str,
              layer: int, phase: str) -> torch.Tensor:
    """One all-to-all of the rows of x, in its probes range."""
    x = x.contiguous()
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    row_bytes = math.prod(x.shape[1:]) * x.element_size()
    with ep.probes.range(name, "ep-comm", bytes=x.shape[0] * row_bytes,
                         remote_bytes=(x.shape[0] - input_splits[ep.rank]) * row_bytes, layer=layer, phase=phase):
        dist.all_to_all_single(out, x, output_split_sizes=output_splits, input_split_sizes=input_splits,
                               group=ep.group)
    return out


def exchange_counts(counts: torch.Tensor, ep: EPGroup, layer: int) -> torch.Tensor:
    """counts [E] (tokens this rank sends to each global expert) -> [ep, E/ep]: row j is what EP rank j sends to
    this rank's local experts. E/ep entries to each rank: the experts it holds."""
    local = counts.numel() // ep.size
    received = _exchange(counts, ep, [local] * ep.size, [local] * ep.size, f"ep all-to-all counts layer{layer}",
                         layer, "forward")
    return received.view(ep.size, local)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, ep, output_splits, input_splits, name, layer):
        ctx.ep, ctx.splits, ctx.name, ctx.layer = ep, (output_splits, input_splits), name, layer
        return _exchange(x, ep, output_splits, input_splits, name, layer, "forward")

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _exchange(grad, ctx.ep, input_splits, output_splits, ctx.name, ctx.layer, "backward"), *[None] * 5


def all_to_all(x: torch.Tensor, ep: EPGroup, output_splits: list[int], input_splits: list[int], name: str,
               layer: int) -> torch.Tensor:
    """Rows of x [sum(input_splits), h] out to the EP ranks, [sum(output_splits), h] back; the backward reverses."""
    return _AllToAll.apply(x, ep, output_splits, input_splits, name, layer)
