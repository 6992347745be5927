"""One GEMM over every local expert's rows (Megatron's --moe-grouped-gemm), with the row counts on the device.

The rows arrive grouped by expert: counts[e] rows for expert e, in expert order, then possibly rows past the last
group (assignments dropped over capacity, sorted last by the dispatcher at EP 1), which belong to no expert. Each
row is multiplied by its expert's weight W_e [n, k] (a linear's [out, in]): y_i = x_i W_e^T. Two ways, chosen by
device and dtype:

- torch._grouped_mm (CUDA, bf16, Hopper or later: GROUPED_MM_DEVICE_TYPES): one kernel over the groups, whose
  boundaries it reads from the cumulative counts on the device, so the host never learns the counts;
- else one batched GEMM over the experts padded to `max_rows` rows each (CPU, fp32, older GPUs): each row is
  scattered to its (expert, place) slot of an [E, max_rows + 1, k] tensor, the extra slot taking the rows past the
  groups, torch.bmm multiplies each expert's block, and the rows are gathered back. It costs E (max_rows + 1) rows of
  work, which at EP 1 (max_rows = the tokens T) is E / k times the grouped kernel's: a fallback, not a fast path.

Rows past the groups come out as zeros and get a zero gradient (`torch.where`, not a product: whatever the kernels
leave in those rows, NaN included, goes nowhere), so a dropped assignment contributes nothing either way.

A grouped linear (`grouped_linear`, GroupedMLP's) multiplies by the experts' weights as one [E, n, k] tensor without
copying them where they lie one stride apart in one storage, as GroupedMLP's experts do in DDP's buffer
(`stacked_weights`; else a stacked copy, made again in backward rather than kept). Its backward runs the dgrad as
one grouped GEMM and each expert's weight gradient as that expert's own GEMM over its rows, the same as a linear's
(tensor_parallel/layers.py weight_grad: into main_grad under the fusion, held under a delay): the rows' split is the
counts, which the forward copied to the host without waiting (HostCounts). Read in backward, that copy holds the
host until the device has run the forward up to it (on mixtral-8x7b-2l one H200's host waited 46 ms a step there);
a delayed weight holds the whole operands and reads its range at the flush instead.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Sequence

import torch

from engine.tensor_parallel.layers import weight_grad

# Device types on which torch._grouped_mm runs (where the dtype and the device allow it): tests add "cpu", where
# torch 2.13's _grouped_mm also runs, to check it against the fallback and SequentialMLP.
GROUPED_MM_DEVICE_TYPES = {"cuda"}


def uses_grouped_mm(x: torch.Tensor) -> bool:
    """torch._grouped_mm for these rows: present in this torch, on an allowed device type, and on CUDA in bf16 on a
    device of compute capability 9.0 or later (its only CUDA kernels)."""
    if not hasattr(torch, "_grouped_mm") or x.device.type not in GROUPED_MM_DEVICE_TYPES:
        return False
    if x.device.type != "cuda":
        return True
    return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)


class HostCounts:
    """The rows per expert on the host: a list the caller already has (EP > 1), or a device tensor's copy started
    without waiting (into pinned memory, an event behind it) and read when first asked for."""

    def __init__(self, counts: torch.Tensor | list[int]):
        self._list = counts if isinstance(counts, list) else None
        self._ready: torch.cuda.Event | None = None
        if isinstance(counts, torch.Tensor):
            if counts.device.type == "cuda":
                self._copy = torch.empty(counts.shape, dtype=counts.dtype, pin_memory=True)
                self._copy.copy_(counts, non_blocking=True)
                self._ready = torch.cuda.Event()
                self._ready.record()
            else:
                self._copy = counts.detach().cpu().clone()

    def tolist(self) -> list[int]:
        if self._list is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._list = self._copy.tolist()
        return self._list


@dataclass(frozen=True)
class ExpertGroups:
    """Where each of N rows goes: offsets (the cumulative counts, int32, as _grouped_mm takes them); `valid` [N] bool
    where rows past the groups may exist, else None; the counts on the host, for the weight gradients; max_rows
    bounds every count (the fallback's padded size)."""
    offsets: torch.Tensor
    num_rows: int
    max_rows: int
    valid: torch.Tensor | None
    host_counts: HostCounts

    @classmethod
    def of(cls, counts: torch.Tensor, num_rows: int, max_rows: int, may_drop: bool,
           host_counts: list[int] | None = None) -> "ExpertGroups":
        """counts [E] int64 on the rows' device (host_counts: the same, where the caller has them as a list);
        may_drop: rows past the groups can exist (a capacity factor at EP 1)."""
        ends = counts.cumsum(0)
        valid = torch.arange(num_rows, device=counts.device) < ends[-1] if may_drop else None
        return cls(offsets=ends.to(torch.int32), num_rows=num_rows, max_rows=max_rows, valid=valid,
                   host_counts=HostCounts(counts if host_counts is None else host_counts))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What a backward keeps of the groups (the offsets, the mask)."""
        return (self.offsets,) if self.valid is None else (self.offsets, self.valid)

    def slots(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fallback's (expert, place within it) of each row; past the groups: expert 0, place max_rows (the
        spare slot)."""
        ends = self.offsets.long()
        rows = torch.arange(self.num_rows, device=ends.device)
        expert = torch.searchsorted(ends, rows, right=True)  # E for a row past the groups
        inside = expert < ends.numel()
        expert = expert.clamp(max=ends.numel() - 1)
        counts = ends.diff(prepend=ends.new_zeros(1))
        place = torch.where(inside, rows - (ends - counts)[expert], self.max_rows)
        return torch.where(inside, expert, 0), place

    def rows_of(self, expert: int) -> tuple[int, int]:
        """The rows [start, end) of the `expert`-th group, from the host's counts (the first call reads them)."""
        counts = self.host_counts.tolist()
        start = sum(counts[:expert])
        return start, start + counts[expert]

    def masked(self, x: torch.Tensor) -> torch.Tensor:
        """x with the rows past the groups set to zero (their gradient too)."""
        return x if self.valid is None else torch.where(self.valid.unsqueeze(-1), x, 0.0)


def _padded_bmm(x: torch.Tensor, weight: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
    slots = groups.slots()
    padded = x.new_zeros((weight.shape[0], groups.max_rows + 1, x.shape[-1])).index_put(slots, x)
    return torch.bmm(padded, weight.transpose(1, 2))[slots]


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
    """x [N, k] grouped by expert, weight [E, n, k] (the experts' linear weights stacked) -> [N, n], rows past the
    groups zero (module docstring)."""
    x = groups.masked(x)
    if uses_grouped_mm(x):
        y = torch._grouped_mm(x, weight.transpose(1, 2), offs=groups.offsets)
    else:
        y = _padded_bmm(x, weight, groups)
    return groups.masked(y)


def stacked_weights(weights: Sequence[torch.Tensor]) -> torch.Tensor:
    """The weights [n, k] each as one [E, n, k] tensor: a view of their storage where they lie one stride apart in
    it, in order (GroupedMLP's experts in DDP's buffer), else a stacked copy."""
    first = weights[0].detach()
    step = weights[1].storage_offset() - first.storage_offset() if len(weights) > 1 else first.numel()
    uniform = step >= first.numel() and all(
        w.is_contiguous() and w.shape == first.shape and w.dtype == first.dtype
        and w.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        and w.storage_offset() == first.storage_offset() + i * step for i, w in enumerate(weights))
    if not uniform:
        return torch.stack([w.detach() for w in weights])
    return first.as_strided((len(weights), *first.shape), (step, *first.stride()), first.storage_offset())


class _GroupedLinear(torch.autograd.Function):
    """y = x W_e^T for each expert's rows (module docstring): the forward's grouped GEMM on the weights' view, the
    backward's dgrad grouped and each expert's weight gradient its own GEMM."""

    @staticmethod
    def forward(ctx, x, groups, *weights):
        # The Parameters themselves, for their DDP attributes (as tensor_parallel/layers.py's linear keeps its own).
        ctx.groups, ctx.params = groups, weights
        ctx.save_for_backward(x, *groups.tensors())  # the groups' tensors too: what autograd holds, seen as such
        return grouped_gemm(x, stacked_weights(weights), groups)

    @staticmethod
    def backward(ctx, grad_output):
        x = ctx.saved_tensors[0]
        groups, params = ctx.groups, ctx.params
        grad_input = None
        if ctx.needs_input_grad[0]:
            grad_input = grouped_gemm(grad_output, stacked_weights(params).transpose(1, 2), groups)
        # the rows past the groups are in no expert's range; a delayed weight reads its range at the flush
        grads = [weight_grad(p, grad_output, x, rows=functools.partial(groups.rows_of, e)) if needs else None
                 for e, (p, needs) in enumerate(zip(params, ctx.needs_input_grad[2:]))]
        return grad_input, None, *grads


def grouped_linear(x: torch.Tensor, weights: list[torch.Tensor], groups: ExpertGroups) -> torch.Tensor:
    """x [N, k] through each expert's linear weight [n, k] (GroupedMLP's experts, in order) as one grouped GEMM."""
    return _GroupedLinear.apply(x, groups, *weights)
