"""Contiguous param/grad buffers, their buckets, and the bucket groups that communicate (docs/buffer_layout.md,
docs/engine.md "Data parallel").

Every parameter of one (param dtype, grad dtype) group lives in one `param_data` tensor and its gradient in one
`grad_data` tensor at the same offset: `param.data` and `param.main_grad` are views. Parameters are laid out in
reverse order of `module.parameters()` so that backward, which produces the last layer's gradients first, fills
the buffer from its head and the first bucket is complete soonest. The layout is the pure function
`build_buffer_layout`; docs/buffer_layout.md states its padding rule, which the ledger re-derives independently.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.distributed as dist

from engine.distributed.distributed_data_parallel_config import (
    DistributedDataParallelConfig,
)
from probes.protocol import ProbeSetProtocol

# torch >= 2.13 renamed the tensor-in/tensor-out collectives; older torch (a megatron-core container) has the old.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

PARAM_START_ALIGNMENT = 64  # elements: 128 bytes at 16-bit, Megatron's _pad_start_of_param_if_needed
BUCKET_END_ALIGNMENT = 128  # elements: 256 bytes at 16-bit, Megatron's _pad_end_of_bucket_if_needed


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class BufferLayout:
    """Where each parameter and bucket sits in a buffer, in elements. Lists over params follow the input order."""
    param_ranges: tuple[tuple[int, int], ...]
    param_buckets: tuple[int, ...]
    bucket_ranges: tuple[tuple[int, int], ...]
    numel: int

    @property
    def order(self) -> list[int]:
        """Input indices in buffer order (the reverse of the input order)."""
        return sorted(range(len(self.param_ranges)), key=lambda i: self.param_ranges[i][0])

    @property
    def numel_params(self) -> int:
        return sum(end - start for start, end in self.param_ranges)

    @property
    def padding(self) -> int:
        return self.numel - self.numel_params

    def bucket_params(self, bucket: int) -> list[int]:
        return [i for i in self.order if self.param_buckets[i] == bucket]


def padding_rule(dp_size: int, use_distributed_optimizer: bool, alignment_padding: bool) -> tuple[int, int]:
    """(param start multiple, bucket end multiple) in elements.

    Only the distributed optimizer needs padding: it shards every bucket into dp_size equal ranges. Megatron also
    aligns param starts to 128 bytes and bucket ends to 256 bytes (cuBLAS and NCCL prefer aligned addresses).
    """
    if not use_distributed_optimizer:
        return 1, 1
    if not alignment_padding:
        return 1, dp_size
    return PARAM_START_ALIGNMENT, math.lcm(dp_size, BUCKET_END_ALIGNMENT)


def build_buffer_layout(param_numels: Sequence[int], bucket_size: int | None, dp_size: int,
                        use_distributed_optimizer: bool, alignment_padding: bool = True,
                        shared_embedding: Sequence[bool] = (), bucket_groups: Sequence[str] = ()) -> BufferLayout:
    """Lay params out last-first; a bucket closes once it holds >= bucket_size elements (None: one bucket), but
    never between two params of one bucket group (bucket_groups[i], "" for none).

    Under the distributed optimizer a shared embedding (shared_embedding[i]: a copy of tied word embeddings on the
    first or last pipeline stage) gets a bucket of its own, as in Megatron: laid out alike on both stages, the same
    DP rank owns the same elements of both copies, so the embedding all-reduce after the reduce-scatter adds shards
    that match. A bucket group is a GroupedMLP layer's expert weights: a bucket's end padding between them would
    break the one stride its grouped GEMMs read them at (as Megatron's GroupedMLP, whose experts are one parameter
    per linear, which no bucket splits).
    """
    start_multiple, end_multiple = padding_rule(dp_size, use_distributed_optimizer, alignment_padding)
    n = len(param_numels)
    own_bucket = [use_distributed_optimizer and bool(s) for s in (shared_embedding or [False] * n)]
    groups = list(bucket_groups) or [""] * n
    ranges: list[tuple[int, int]] = [(0, 0)] * n
    buckets: list[int] = [0] * n
    bucket_ranges: list[tuple[int, int]] = []
    bucket_start = cursor = 0
    open_bucket = False
    for i in reversed(range(n)):
        start = _round_up(cursor, start_multiple)
        if own_bucket[i] and open_bucket:
            start = _round_up(start, end_multiple)
            bucket_ranges.append((bucket_start, start))
            bucket_start = start
        end = start + param_numels[i]
        ranges[i], buckets[i], open_bucket = (start, end), len(bucket_ranges), True
        cursor = end
        group_continues = i > 0 and groups[i] != "" and groups[i - 1] == groups[i]
        if own_bucket[i] or (bucket_size is not None and end - bucket_start >= bucket_size and not group_continues):
            cursor = _round_up(end, end_multiple)
            bucket_ranges.append((bucket_start, cursor))
            bucket_start, open_bucket = cursor, False
    if open_bucket:
        cursor = _round_up(cursor, end_multiple)
        bucket_ranges.append((bucket_start, cursor))
    return BufferLayout(tuple(ranges), tuple(buckets), tuple(bucket_ranges), cursor)


def shard_buffer(buffer: torch.Tensor, dp_size: int) -> list[torch.Tensor]:
    """dp_size equal views of a 1-D buffer; rank r owns [r*n/dp, (r+1)*n/dp)."""
    assert buffer.numel() % dp_size == 0, f"{buffer.numel()} elements do not split over {dp_size} ranks"
    size = buffer.numel() // dp_size
    return [buffer[r * size:(r + 1) * size] for r in range(dp_size)]


class _ParamAndGradBucket:
    """A contiguous slice of a buffer: the unit of communication and of the distributed optimizer's sharding."""

    def __init__(self, params: list[torch.nn.Parameter], param_data: torch.Tensor, grad_data: torch.Tensor,
                 offset: int, bucket_id: int):
        self.params = set(params)
        self.param_data = param_data
        self.grad_data = grad_data
        self.offset = offset  # of this bucket in its buffer
        self.bucket_id = bucket_id
        self.padding = grad_data.numel() - sum(p.numel() for p in params)


class _ParamAndGradBucketGroup:
    """Buckets whose collectives are issued together; DDP makes one group per bucket.

    Grad sync: with overlap_grad_reduce the backward hooks count ready params and the last one of the last
    micro-batch issues the async reduce-scatter (distributed optimizer) or all-reduce; finish_grad_sync waits.
    Without overlap, finish_grad_sync issues it synchronously. Gradients are averaged over the DP group.
    Param sync (distributed optimizer only): an all-gather of each bucket's param_data from the owners' shards.
    Over a DP group of one rank both are the identity (the average of one gradient, a shard that is the whole
    bucket): no collective is issued and none is announced to the probes, since nothing moves.

    Expert buckets (`expert`, parameters with allreduce False) are reduced over the expert-data-parallel group, which
    is smaller than the group their tokens came from: each expert's gradient already sums over the EP ranks that
    routed tokens to it. So they are not averaged over their own group but scaled by gradient_scaling_factor
    (1/(dp x cp), as Megatron's expert_gradient_scaling_factor) and summed; the scaling happens even when the expert
    group has one rank and nothing is communicated, but not at a factor of 1 (as Megatron's start_grad_sync: a pass
    over every expert gradient for nothing, 5.4 ms a step on mixtral-8x7b-2l's 2.8 B on one H200). Their probe
    ranges carry expert=True.
    """

    def __init__(self, buckets: list[_ParamAndGradBucket], ddp_config: DistributedDataParallelConfig,
                 data_parallel_group: Any, index: int, probes: ProbeSetProtocol,
                 gradient_scaling_factor: float | None = None):
        """gradient_scaling_factor None: average over data_parallel_group (dense); else scale, then sum (expert)."""
        self.buckets = buckets
        self.ddp_config = ddp_config
        self.data_parallel_group = data_parallel_group
        self.gradient_scaling_factor = gradient_scaling_factor
        # Probe attributes: dense ranges keep exactly their old attributes; expert ones add expert=True.
        self.attrs: dict[str, Any] = {"bucket": index, **({"expert": True} if gradient_scaling_factor else {})}
        self.dp_size = data_parallel_group.size()
        self.dp_rank = data_parallel_group.rank()
        self.index = index
        self.probes = probes
        self.params = set().union(*(b.params for b in buckets))
        self.grad_shards = [shard_buffer(b.grad_data, self.dp_size)[self.dp_rank] for b in buckets]
        self.param_shards = [shard_buffer(b.param_data, self.dp_size)[self.dp_rank] for b in buckets]
        self.next_param_gather_bucket_group: _ParamAndGradBucketGroup | None = None
        self.grad_reduce_handles: list[tuple[Any, Any]] = []
        self.param_gather_handles: list[tuple[Any, Any]] = []
        # True when the all-gather for the latest optimizer update has been issued. The model starts replicated,
        # so nothing is owed before the first step; finish_grad_sync (i.e. an update is coming) clears it.
        self.param_gather_dispatched = True
        self.reset()

    def reset(self) -> None:
        self.params_with_grad: set[torch.nn.Parameter] = set()
        self.is_last_microbatch = True
        self.grad_reduce_issued = False

    # -- gradients ---------------------------------------------------------------------------------------------
    def start_grad_sync(self) -> None:
        """Issue this step's reduction once: the hooks and a schedule's grad_sync_func may both ask for it."""
        if self.grad_reduce_issued:
            return
        self.grad_reduce_issued = True
        if self.gradient_scaling_factor not in (None, 1.0):
            for bucket in self.buckets:
                bucket.grad_data.mul_(self.gradient_scaling_factor)
        if self.dp_size == 1:
            return
        async_op = self.ddp_config.overlap_grad_reduce
        kind = "reduce-scatter" if self.ddp_config.use_distributed_optimizer else "all-reduce"
        op = dist.ReduceOp.AVG if self.gradient_scaling_factor is None else dist.ReduceOp.SUM
        for bucket, shard in zip(self.buckets, self.grad_shards):
            if self.ddp_config.use_distributed_optimizer:
                def issue(bucket=bucket, shard=shard):
                    return _reduce_scatter(shard, bucket.grad_data, op=op, group=self.data_parallel_group,
                                           async_op=async_op)
            else:
                def issue(bucket=bucket, shard=shard):
                    return dist.all_reduce(bucket.grad_data, op=op, group=self.data_parallel_group, async_op=async_op)
            self.grad_reduce_handles.append(self.probes.comm_issue(
                f"{kind} bucket{self.index}", "dp-comm", issue, **self.attrs,
                bytes=bucket.grad_data.numel() * bucket.grad_data.element_size(), numel=bucket.grad_data.numel()))
        if not async_op:
            self._wait(self.grad_reduce_handles)

    def finish_grad_sync(self) -> None:
        self.param_gather_dispatched = False
        if not self.ddp_config.overlap_grad_reduce:
            self.start_grad_sync()
        assert self.grad_reduce_issued, (
            f"bucket group {self.index}: no grad reduction was issued "
            f"({len(self.params_with_grad)}/{len(self.params)} params had their gradient ready)")
        self._wait(self.grad_reduce_handles)
        self.grad_reduce_issued = False

    def register_grad_ready(self, param: torch.nn.Parameter) -> None:
        if not self.is_last_microbatch:
            return
        assert param not in self.params_with_grad, "a parameter's gradient became ready twice in one step"
        self.params_with_grad.add(param)
        if len(self.params_with_grad) == len(self.params):
            self.start_grad_sync()

    # -- parameters --------------------------------------------------------------------------------------------
    def start_param_sync(self, force_sync: bool = False) -> None:
        """Issue the all-gather owed for the latest update (once); force_sync also waits for it."""
        assert self.ddp_config.use_distributed_optimizer
        if not self.param_gather_dispatched and self.dp_size > 1:
            async_op = self.ddp_config.overlap_param_gather and not force_sync
            for bucket, shard in zip(self.buckets, self.param_shards):
                self.param_gather_handles.append(self.probes.comm_issue(
                    f"all-gather bucket{self.index}", "dp-comm",
                    lambda bucket=bucket, shard=shard: _all_gather(bucket.param_data, shard,
                                                                   group=self.data_parallel_group, async_op=async_op),
                    **self.attrs, bytes=bucket.param_data.numel() * bucket.param_data.element_size(),
                    numel=bucket.param_data.numel()))
        self.param_gather_dispatched = True
        if force_sync or not self.ddp_config.overlap_param_gather:
            self._wait(self.param_gather_handles)

    def finish_param_sync(self) -> None:
        """Forward pre-hook side: wait for this group's all-gather, then issue the next group's."""
        if not self.param_gather_dispatched:
            self.start_param_sync()
        if self.param_gather_handles:
            self._wait(self.param_gather_handles)
            following = self.next_param_gather_bucket_group
            if following is not None and not following.param_gather_dispatched:
                following.start_param_sync()

    def _wait(self, handles: list[tuple[Any, Any]]) -> None:
        for work, token in handles:
            if work is not None:
                work.wait()
            self.probes.comm_end(token)
        handles.clear()


class _ParamAndGradBuffer:
    """One contiguous param_data and grad_data for the params of one (param dtype, grad dtype), dense or expert.

    An expert buffer (`expert`: Megatron's expert_parallel_buffers) holds parameters with allreduce False; its
    data_parallel_group is the expert-data-parallel group, which both its padding (shards over that group's size)
    and the distributed optimizer's shards follow."""

    def __init__(self, ddp_config: DistributedDataParallelConfig, param_dtype: torch.dtype,
                 grad_dtype: torch.dtype, params: list[torch.nn.Parameter], data_parallel_group: Any,
                 bucket_size: int | None, expert: bool = False):
        self.ddp_config = ddp_config
        self.param_dtype = param_dtype
        self.grad_dtype = grad_dtype
        self.data_parallel_group = data_parallel_group
        self.expert = expert
        self.dp_size = data_parallel_group.size()
        self.layout = build_buffer_layout([p.numel() for p in params], bucket_size, self.dp_size,
                                          ddp_config.use_distributed_optimizer, ddp_config.alignment_padding,
                                          [getattr(p, "shared_embedding", False) for p in params],
                                          [getattr(p, "bucket_group", "") for p in params])
        self.numel = self.layout.numel
        device = params[0].device
        self.param_data = torch.zeros(self.numel, dtype=param_dtype, device=device)
        self.grad_data = torch.zeros(self.numel, dtype=grad_dtype, device=device)
        self.param_index_map: dict[torch.nn.Parameter, tuple[int, int]] = {}
        for param, (start, end) in zip(params, self.layout.param_ranges):
            view = self.param_data[start:end].view(param.shape)
            view.copy_(param.data)
            param.data = view
            param.main_grad = self.grad_data[start:end].view(param.shape)
            self.param_index_map[param] = (start, end)
        self.params = [params[i] for i in self.layout.order]
        self.buckets = [self._bucket(b, params) for b in range(len(self.layout.bucket_ranges))]

    def _bucket(self, bucket_id: int, params: list[torch.nn.Parameter]) -> _ParamAndGradBucket:
        start, end = self.layout.bucket_ranges[bucket_id]
        members = self.layout.bucket_params(bucket_id)
        return _ParamAndGradBucket([params[i] for i in members], self.param_data[start:end],
                                   self.grad_data[start:end], start, bucket_id)

    def reset(self) -> None:
        self.grad_data.zero_()

    def inventory(self, name: str) -> list[dict[str, Any]]:
        buckets = [{"index": b.bucket_id, "start": b.offset, "end": b.offset + b.grad_data.numel(),
                    "numel": b.grad_data.numel(), "padding": b.padding} for b in self.buckets]
        return [{"name": f"{name}.{kind}", "kind": kind.replace("_data", "_buffer"), "dtype": str(t.dtype),
                 "numel": t.numel(), "bytes": t.numel() * t.element_size(), "padding": self.layout.padding,
                 "padding_bytes": self.layout.padding * t.element_size(), "buckets": buckets,
                 **({"expert": True} if self.expert else {})}
                for kind, t in (("param_data", self.param_data), ("grad_data", self.grad_data))]
