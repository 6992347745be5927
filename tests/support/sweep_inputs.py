"""The compute sweep's inputs as the engine hands them over (engine/training.py): its own fused kernels, eager on
the CPU, and a stage's SweepSpec."""
from __future__ import annotations

import functools

from common.config import RunConfig
from engine.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from engine.tensor_parallel.layers import pad_vocab_size
from engine.tensor_parallel.mappings import TPGroup
from engine.transformer.attention import split_qkv_and_rotate
from engine.transformer.mlp import swiglu
from ledger.models.formulas.params import params_total
from probes.compute_sweep import EngineKernels, SweepSpec


def engine_kernels(vocab_size: int) -> EngineKernels:
    """The engine's own fused functions, as engine/training.py hands them to the sweep (eager on CPU)."""
    return EngineKernels(split_qkv_and_rotate=split_qkv_and_rotate, swiglu=swiglu,
                         cross_entropy=functools.partial(vocab_parallel_cross_entropy,
                                                         tp=TPGroup(group=None, size=1, rank=0),
                                                         vocab_size=vocab_size),
                         variant="eager")


def spec(c: RunConfig, stage: int) -> SweepSpec:
    """Stage `stage`'s sweep of config `c`, its optimizer and grad buffer sized as the whole model."""
    tp, p, m = c.parallel.tensor_model_parallel_size, c.parallel.pipeline_model_parallel_size, c.model
    numel = params_total(c)
    return SweepSpec.from_run(c, tp_size=tp, padded_vocab_size=pad_vocab_size(m.vocab_size,
                                                                              m.make_vocab_size_divisible_by, tp),
                              first_stage=stage == 0, last_stage=stage == p - 1, optimizer_numel=numel,
                              grad_buffer_numel=numel)
