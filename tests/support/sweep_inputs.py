"""The compute sweep's inputs as the engine hands them over (engine/probe_adapters.py): its own fused kernels, eager
on the CPU, and a stage's SweepSpec."""
from __future__ import annotations

import torch

from common.config import RunConfig
from engine.probe_adapters import engine_kernels
from ledger.models.formulas.params import params_total
from probes.compute_sweep import EngineKernels, SweepSpec

CPU = torch.device("cpu")


def kernels(c: RunConfig) -> EngineKernels:
    """The engine's own functions as engine/probe_adapters.py hands them to the sweep (eager on CPU; no MoE layer)."""
    return engine_kernels([], c.model.vocab_size, CPU, c.implementation.gradient_accumulation_fusion)


def spec(c: RunConfig, stage: int) -> SweepSpec:
    """Stage `stage`'s sweep of config `c`, its optimizer and grad buffer sized as the whole model."""
    numel, last = params_total(c), c.parallel.pipeline_model_parallel_size - 1
    return SweepSpec.from_run(c, first_stage=stage == 0, last_stage=stage == last, optimizer_numel=numel,
                              grad_buffer_numel=numel)
