"""Token dispatch and combine over the expert-parallel group (Megatron's MoEAlltoAllTokenDispatcher), tp = 1.

dispatch (this rank's T tokens, each routed to k experts):
1. permute: the kept assignments sorted by expert (stable: token order within an expert), one row per assignment,
   so the rows bound for EP rank j (its experts are contiguous) are contiguous;
2. exchange counts: an all-to-all of the per-expert counts tells each rank how many rows it receives from each
   rank for each of its local experts (the split sizes; read on the host, as Megatron does);
3. all-to-all of the rows (an autograd Function whose backward is the reverse all-to-all);
4. regroup: received rows are ordered (source rank, local expert); the experts want (local expert, source rank).
combine reverses 4 and 3, then unpermutes: each token's output is the sum over its k slots of the routing
probability times the expert's output row (zero for a dropped assignment), summed in slot order in fp32.

EP = 1 skips 2-4 and takes no collective. With keep_counts_on_device (GroupedMLP's experts at EP 1) the host never
reads the counts: every assignment's row is gathered, the dropped ones sorted last (T k rows, a size the host knows),
the counts go to the experts as a device tensor, and combine maps a dropped slot to its zero row by the routing's
`kept` mask instead of by the kept count.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.jit import jit_fuser
from engine.transformer.moe.expert_parallel import EPGroup, all_to_all, exchange_counts
from engine.transformer.moe.router import Routing, count_per_expert


@dataclass
class DispatchPlan:
    """What combine needs from its dispatch."""
    probs: torch.Tensor  # [T, k] fp32
    slot_rows: torch.Tensor  # [T, k] row of each assignment in the permuted rows; N (a zero row) if dropped
    send_splits: list[int]  # rows sent to each EP rank
    receive_counts: list[list[int]]  # [source rank][local expert] rows received; [] while the counts stay on device


def _unpermute(rows: torch.Tensor, slot_rows: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """rows [N, h], slot_rows [T, k] (N: a dropped slot's zero row), probs [T, k] -> [T, h]: each token's
    probability-weighted sum of its slots' rows, in fp32, rounded once."""
    padded = torch.cat((rows, rows.new_zeros((1, rows.shape[-1]))))
    return (padded[slot_rows].float() * probs.unsqueeze(-1)).sum(dim=1).to(rows.dtype)


# One gather-multiply-sum kernel each way on GPU instead of a chain over [T, k, h] fp32 copies; N varies under EP > 1.
unpermute = jit_fuser(_unpermute, dynamic_rows=True)


def _reorder_chunks(rows: torch.Tensor, counts: list[list[int]]) -> torch.Tensor:
    """rows in chunks ordered (a, b) with counts[a][b] rows each -> the same chunks ordered (b, a)."""
    chunks = rows.split([c for row in counts for c in row])
    width = len(counts[0])
    return torch.cat([chunks[a * width + b] for b in range(width) for a in range(len(counts))])


def _transpose(counts: list[list[int]]) -> list[list[int]]:
    return [list(column) for column in zip(*counts)]


class MoEAlltoAllTokenDispatcher:
    def __init__(self, num_experts: int, ep: EPGroup, layer_number: int, keep_counts_on_device: bool = False):
        """keep_counts_on_device: at EP 1, hand the experts the counts as a device tensor, never read on the host
        (module docstring); ignored under EP > 1, whose all-to-alls take their split sizes from the host."""
        self.num_experts, self.ep, self.layer_number = num_experts, ep, layer_number
        self.num_local_experts = num_experts // ep.size
        self.keep_counts_on_device = keep_counts_on_device and ep.size == 1

    def dispatch(self, hidden_states: torch.Tensor,
                 routing: Routing) -> tuple[torch.Tensor, list[int] | torch.Tensor, DispatchPlan]:
        """hidden_states [T, h] -> (rows grouped by local expert, rows per local expert, the plan for combine)."""
        num_tokens, topk = routing.experts.shape
        key = torch.where(routing.kept, routing.experts, self.num_experts).reshape(-1)  # dropped sort last
        order = torch.argsort(key, stable=True)
        counts = count_per_expert(key, self.num_experts + 1)[:self.num_experts]  # kept rows per expert
        slot_rows = torch.empty_like(order)
        slot_rows[order] = torch.arange(order.numel(), device=order.device)
        if self.keep_counts_on_device:
            rows = order.numel()  # every assignment's row: combine's zero row follows them
            plan = DispatchPlan(routing.probs, torch.where(routing.kept, slot_rows.view(num_tokens, topk), rows),
                                [rows], [])
            return hidden_states[order // topk], counts, plan
        if self.ep.size == 1:
            receive_counts = [counts.tolist()]
            send_splits = [sum(receive_counts[0])]
        else:
            receive_counts = exchange_counts(counts, self.ep, self.layer_number).tolist()
            send_splits = counts.view(self.ep.size, self.num_local_experts).sum(dim=1).tolist()
        kept = sum(send_splits)
        rows = hidden_states[order[:kept] // topk]
        if self.ep.size > 1:
            rows = all_to_all(rows, self.ep, [sum(c) for c in receive_counts], send_splits,
                              f"ep all-to-all dispatch layer{self.layer_number}", self.layer_number)
            rows = _reorder_chunks(rows, receive_counts)
        plan = DispatchPlan(routing.probs, slot_rows.clamp(max=kept).view(num_tokens, topk), send_splits,
                            receive_counts)
        return rows, [sum(c) for c in _transpose(receive_counts)], plan

    def combine(self, expert_output: torch.Tensor, plan: DispatchPlan) -> torch.Tensor:
        """The experts' rows (grouped as dispatch returned them) -> [T, h]: each token's probability-weighted sum."""
        if self.ep.size > 1:
            by_source = _reorder_chunks(expert_output, _transpose(plan.receive_counts))
            expert_output = all_to_all(by_source, self.ep, plan.send_splits, [sum(c) for c in plan.receive_counts],
                                       f"ep all-to-all combine layer{self.layer_number}", self.layer_number)
        return unpermute(expert_output, plan.slot_rows, plan.probs)
