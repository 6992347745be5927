"""What one rank's sweep times: the catalogue's entries for its stage (common/ops: every kernel at the rank's
TP-local, CP-local shapes) and its per-element work at the engine's own element counts."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.ops import RankOps, Shapes, rank_ops


@dataclass(frozen=True)
class SweepSpec:
    shapes: Shapes
    first_stage: bool
    last_stage: bool
    optimizer_numel: int  # the rank's main params
    grad_buffer_numel: int  # its grad buffers' elements

    @classmethod
    def from_run(cls, run_config: Any, *, first_stage: bool, last_stage: bool, optimizer_numel: int,
                 grad_buffer_numel: int) -> "SweepSpec":
        return cls(Shapes.of(run_config), first_stage=first_stage, last_stage=last_stage,
                   optimizer_numel=optimizer_numel, grad_buffer_numel=grad_buffer_numel)

    @property
    def ops(self) -> RankOps:
        return rank_ops(self.shapes, self.first_stage, self.last_stage)

