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
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

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


@dataclass(frozen=True)
class ExpertGroups:
    """Where each of N rows goes: offsets (the cumulative counts, int32, as _grouped_mm takes them); for the fallback
    each row's expert and place within it (past the groups: expert 0, place max_rows, the spare slot); `valid` [N]
    bool where rows past the groups may exist, else None."""
    offsets: torch.Tensor
    expert: torch.Tensor
    place: torch.Tensor
    max_rows: int
    valid: torch.Tensor | None

    @classmethod
    def of(cls, counts: torch.Tensor, num_rows: int, max_rows: int, may_drop: bool) -> "ExpertGroups":
        """counts [E] int64 on the rows' device; max_rows bounds every count (the fallback's padded size);
        may_drop: rows past the groups can exist (a capacity factor at EP 1)."""
        ends = counts.cumsum(0)
        rows = torch.arange(num_rows, device=counts.device)
        expert = torch.searchsorted(ends, rows, right=True)  # E for a row past the groups
        inside = expert < counts.numel()
        expert = expert.clamp(max=counts.numel() - 1)
        place = torch.where(inside, rows - (ends - counts)[expert], max_rows)
        return cls(offsets=ends.to(torch.int32), expert=torch.where(inside, expert, 0), place=place,
                   max_rows=max_rows, valid=inside if may_drop else None)

    def masked(self, x: torch.Tensor) -> torch.Tensor:
        """x with the rows past the groups set to zero (their gradient too)."""
        return x if self.valid is None else torch.where(self.valid.unsqueeze(-1), x, 0.0)


def _padded_bmm(x: torch.Tensor, weight: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
    padded = x.new_zeros((weight.shape[0], groups.max_rows + 1, x.shape[-1]))
    padded = padded.index_put((groups.expert, groups.place), x)
    return torch.bmm(padded, weight.transpose(1, 2))[groups.expert, groups.place]


def grouped_gemm(x: torch.Tensor, weight: torch.Tensor, groups: ExpertGroups) -> torch.Tensor:
    """x [N, k] grouped by expert, weight [E, n, k] (the experts' linear weights stacked) -> [N, n], rows past the
    groups zero (module docstring)."""
    x = groups.masked(x)
    if uses_grouped_mm(x):
        y = torch._grouped_mm(x, weight.transpose(1, 2), offs=groups.offsets)
    else:
        y = _padded_bmm(x, weight, groups)
    return groups.masked(y)


def grouped_linear(x: torch.Tensor, weights: list[torch.Tensor], groups: ExpertGroups) -> torch.Tensor:
    """x [N, k] through each expert's linear weight [n, k] (GroupedMLP's experts, in order), stacked for the call:
    a copy of the weights that the GEMM keeps for backward; stack's backward hands each weight its slice."""
    return grouped_gemm(x, torch.stack(weights), groups)
