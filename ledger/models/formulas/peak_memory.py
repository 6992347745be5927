"""Peak memory of each pipeline stage: what decides whether a layout fits, shared by `plan`, `simulate` and the layout
search; reconcile's judged memory.peak_allocated row makes the same sum for each rank's own DP shard.

A stage's peak, on one TP rank of its largest DP rank (static_memory.py: the distributed optimizer's shards differ by
a few elements between DP ranks), after the first step:
    static (param and grad buffers, fp32 main params, grad copy, Adam m and v)
  + saved activations at the schedule's peak (activations.stage_activation_bytes, under the run's recompute mode).
The logits transient (activations.logits_transient_bytes: the 16-bit logits or their gradient beside the saved fp32
softmax) is reported beside it, not added: on every real H200 run we have (tests/fixtures/h200_llama1b: seq 4096 and
8192, each recompute mode, the 8B shape) the allocator's measured peak equals static + activations within 0.3%, and
adding the transient (1 to 2 GB there) overestimates each by that much (tests/test_h200_claims.py). With the loss
fused over chunks (--cross-entropy-fusion-impl linear) there is no such transient: the chunk's logits are in the
last stage's activations (activations.last_stage_extra_bytes).
Not counted: the CUDA context, NCCL buffers, allocator fragmentation (device_memory.py estimates what lies outside
PyTorch; the caller adds it where it judges a device's capacity).
"""
from __future__ import annotations

from dataclasses import dataclass

from common.config import RunConfig
from ledger.models.formulas.activations import (
    logits_transient_bytes,
    stage_activation_bytes,
)
from ledger.models.formulas.static_memory import StaticBytes, static_bytes_per_stage


@dataclass(frozen=True)
class StagePeak:
    static: StaticBytes
    activations: int
    logits_transient: int

    @property
    def total(self) -> int:
        return self.static.total + self.activations


def stage_peaks(cfg: RunConfig, static: list[StaticBytes] | None = None) -> list[StagePeak]:
    """Every stage's peak and its parts. `static`: static_bytes_per_stage(cfg), when the caller has it already (the
    same run under several recompute modes shares it: recompute changes activations only)."""
    pp = cfg.parallel.pipeline_model_parallel_size
    static = static_bytes_per_stage(cfg) if static is None else static
    return [StagePeak(static=static[i], activations=stage_activation_bytes(cfg, i),
                      logits_transient=logits_transient_bytes(cfg) if i == pp - 1 else 0) for i in range(pp)]


def peak_bytes_per_stage(cfg: RunConfig) -> list[int]:
    return [stage.total for stage in stage_peaks(cfg)]
