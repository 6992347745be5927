"""Peak memory of each pipeline stage: what decides whether a layout fits, shared by `plan`, `simulate` and the layout
search; reconcile's judged memory.peak_allocated row makes the same sum for each rank's own DP shard.

A stage's peak, on one TP rank of its largest DP rank (static_memory.py: the distributed optimizer's shards differ by
a few elements between DP ranks), after the first step:
    static (param and grad buffers, fp32 main params, grad copy, Adam m and v)
  + what the allocator keeps between steps beside it (`persistent`): the cuBLAS / cuBLASLt workspaces of the device
    (a calibration constant, 64 MiB on an H200; zero where the device is not known), Megatron-LM's global memory
    buffer (core_attention.persistent_buffer_bytes) and the iteration's batches its rerun data iterator keeps
    (peak_phases.kept_batch_bytes: TP rank 0 of the stages that load data, the largest of a stage's TP ranks) and
    under --cuda-graph-impl local what the graphs keep (cuda_graphs.py)
  + the largest of the step's phases (peak_phases.py): saved activations at the schedule's peak, and for
    Megatron-LM's layers the transients beside them (the loss's 16-bit logits, unfused attention's score matrices,
    the optimizer's temporaries).
For this engine the phases are the saved activations at the schedule's peak and, on the last stage, the loss's and
the output layer's backwards (peak_phases.output_backward): on every real H200 run we have the allocator's measured
peak equals static + workspaces + the largest within 0.3% (tests/test_h200_claims.py).
Not counted: the CUDA context, NCCL buffers, allocator fragmentation (device_memory.py estimates what lies outside
PyTorch; the caller adds it where it judges a device's capacity).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.config import RunConfig
from ledger.models.formulas.core_attention import persistent_buffer_bytes
from ledger.models.formulas.cuda_graphs import graph_bytes
from ledger.models.formulas.peak_phases import Phase, kept_batch_bytes, peak_phase
from ledger.models.formulas.static_memory import StaticBytes, static_bytes_per_stage

WORKSPACES = "cuBLAS / cuBLASLt workspaces"
GLOBAL_BUFFER = "Megatron's global memory buffer"
KEPT_BATCHES = "the iteration's batches (Megatron-LM's rerun data iterator keeps them)"


@dataclass(frozen=True)
class StagePeak:
    static: StaticBytes
    activations: int  # the peak phase's saved tensors and transients
    phase: Phase | None = None
    persistent: dict[str, int] = field(default_factory=dict)  # kept between steps beside the static state

    @property
    def between_steps(self) -> int:
        """What the allocator holds between steps: static + persistent."""
        return self.static.total + sum(self.persistent.values())

    @property
    def total(self) -> int:
        return self.between_steps + self.activations


def persistent_bytes(cfg: RunConfig, workspaces: int = 0, pp_rank: int = 0, tp_rank: int = 0) -> dict[str, int]:
    """What stays allocated between steps beside the static state on a rank, by name (zero terms left out)."""
    terms = {WORKSPACES: workspaces, GLOBAL_BUFFER: persistent_buffer_bytes(cfg),
             KEPT_BATCHES: kept_batch_bytes(cfg, pp_rank, tp_rank), **graph_bytes(cfg, workspaces)}
    return {name: n for name, n in terms.items() if n}


def stage_peaks(cfg: RunConfig, static: list[StaticBytes] | None = None, workspaces: int = 0) -> list[StagePeak]:
    """Every stage's peak and its parts. `static`: static_bytes_per_stage(cfg), when the caller has it already (the
    same run under several recompute modes shares it: recompute changes activations only). `workspaces`: the
    device's allocator workspaces (a hardware file's or a device calibration's; 0 when no device is named)."""
    pp = cfg.parallel.pipeline_model_parallel_size
    static = static_bytes_per_stage(cfg) if static is None else static
    peaks = []
    for i in range(pp):  # TP rank 0: the one that keeps the batches, where they are kept
        phase = peak_phase(cfg, i)
        peaks.append(StagePeak(static=static[i], activations=phase.total, phase=phase,
                               persistent=persistent_bytes(cfg, workspaces, i)))
    return peaks


def peak_bytes_per_stage(cfg: RunConfig) -> list[int]:
    return [stage.total for stage in stage_peaks(cfg)]
