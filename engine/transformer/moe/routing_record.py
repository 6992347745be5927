"""Routing counts for the step record (team sheet's MoE step record; the ledger reads them).

Each MoE layer keeps, on the device, the step's token -> expert assignments per expert (before capacity dropping),
the assignments dropped over capacity, and the sum of its load-balancing losses over the step's forwards; the
training loop takes them once per step (moe_layer.moe_step_figures, after the step's one host synchronisation) into
probes.step_end as `moe_tokens_per_expert` / `moe_dropped_tokens` ({"<global layer>": [E ints]}) and
`moe_aux_loss` (summed over this rank's layers, averaged over micro-batches).

Counted: forwards that build a graph for backward. Not counted: forwards without grad (evaluation), and the re-run
of a forward under full recompute: torch.utils.checkpoint (non-reentrant) runs it again from inside the backward,
which is how it is told apart here, with the signal torch's checkpoint itself reads (the autograd engine has a
current graph task only while it runs a backward).
"""
from __future__ import annotations

import torch

from engine.transformer.moe.router import Routing


def counted_forward() -> bool:
    return torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1


class RoutingRecord:
    """One MoE layer's routing counts since the last take()."""

    def __init__(self, num_experts: int):
        self.num_experts = num_experts
        self.tokens: torch.Tensor | None = None
        self.dropped: torch.Tensor | None = None
        self.aux_loss_sum: torch.Tensor | None = None
        self.forwards = 0

    def add(self, routing: Routing) -> None:
        if not counted_forward():
            return
        if self.tokens is None:
            self.tokens = torch.zeros_like(routing.tokens_per_expert)
            self.dropped = torch.zeros_like(routing.dropped_per_expert)
            self.aux_loss_sum = torch.zeros_like(routing.aux_loss)
        self.tokens += routing.tokens_per_expert
        self.dropped += routing.dropped_per_expert
        self.aux_loss_sum += routing.aux_loss
        self.forwards += 1

    def take(self) -> tuple[list[int], list[int], float]:
        """(tokens per expert, dropped per expert, mean load-balancing loss per forward), then start afresh."""
        if self.forwards == 0:
            return [0] * self.num_experts, [0] * self.num_experts, 0.0
        taken = self.tokens.tolist(), self.dropped.tolist(), self.aux_loss_sum.item() / self.forwards
        self.tokens = self.dropped = self.aux_loss_sum = None
        self.forwards = 0
        return taken

