"""The most tokens/s a layout can reach: a cheap upper bound that lets the layout search skip the full step replay
of layouts that cannot reach its top K.

`calibrated_bound` prices each model chunk from one layer's ops times the chunk's layers plus its ends, at the kernel
times the replay uses, so an 80-layer model costs no more than a 1-layer one; the step then takes at least the busiest
stage's work or the dependency chain through the pipeline, plus the largest optimizer step. The derivation, and why
it never falls below the replay's prediction: docs/formulas.md, "The search's bound".
"""
from __future__ import annotations

from collections.abc import Callable

from common.config import RunConfig
from common.ops import Shapes
from common.ops.rank import optimizer_rate
from ledger.models.formulas.activations import checkpoint_groups, layers_per_chunk
from ledger.models.formulas.flops import tokens_per_step
from ledger.models.formulas.params import num_chunks
from ledger.models.formulas.static_memory import owned_per_dp_rank
from ledger.models.time_model import ops
from ledger.models.time_model.calibration import Calibration
from ledger.models.time_model.compute import price


def chunk_seconds(cfg: RunConfig, cal: Calibration) -> list[list[tuple[float, float]]]:
    """(forward, backward) seconds of one micro-batch through each chunk of each stage, as compute.stage_time prices
    them, from one layer's ops: the chunk's layers x one layer, its recompute groups, its ends."""
    sh = ops.Shapes.of(cfg)
    prefix = "decoder.layers.0."
    layer_f = price(ops.layer_forward(sh, prefix), cfg, cal, forward=True).seconds
    layer_b = price(ops.layer_backward(sh, prefix, cfg.recompute.recompute_granularity == "selective"), cfg, cal,
                    forward=False).seconds
    rerun: dict[int, float] = {}

    def body(s: int, c: int) -> tuple[float, float]:
        """(forward, backward) of a chunk's layers (chunks may hold different counts)."""
        groups = checkpoint_groups(cfg, s, c)
        for g, checkpointed in groups:
            if checkpointed and g not in rerun:
                rerun[g] = price(ops.recomputed(sh, list(range(g))), cfg, cal, forward=False).seconds
        layers = layers_per_chunk(cfg, s, c)
        return layers * layer_f, layers * layer_b + sum(rerun[g] for g, checkpointed in groups if checkpointed)

    out = []
    for s in range(cfg.parallel.pipeline_model_parallel_size):
        chunks = []
        for c in range(num_chunks(cfg)):
            body_f, body_b = body(s, c)
            first, last = ops.chunk_ends(cfg, s, c)
            weight = ops.output_param(cfg, s, c) if last else None
            f = body_f + (_seconds(ops.embedding_forward(sh), cfg, cal) if first else 0.0) + (
                _seconds(ops.head_forward(sh, weight), cfg, cal) if last else 0.0)
            b = body_b + (_seconds(ops.embedding_backward(sh), cfg, cal) if first else 0.0) + (
                _seconds(ops.head_backward(sh, weight), cfg, cal) if last else 0.0)
            chunks.append((f, b))
        out.append(chunks)
    return out


def _seconds(work: list[ops.Work], cfg: RunConfig, cal: Calibration) -> float:
    return price(work, cfg, cal, forward=True).seconds


def calibrated_min_step_seconds(cfg: RunConfig, cal: Calibration) -> float:
    """The least step time the replay can predict (module docstring): the chain or the busiest stage, then the
    largest optimizer step."""
    m = cfg.num_microbatches
    chunks = chunk_seconds(cfg, cal)
    work = [m * sum(f + b for f, b in stage) for stage in chunks]
    chain = sum(sum(stage[0]) for stage in chunks[:-1]) + work[-1]
    dtype = cfg.train.params_dtype
    optimizer = max(cal.rate_seconds(optimizer_rate(Shapes.of(cfg)).name, dtype, max(owned_per_dp_rank(cfg, s)))
                    for s in range(cfg.parallel.pipeline_model_parallel_size))
    return max(chain, max(work)) + optimizer


def calibrated_bound(calibration: Callable[[RunConfig], Calibration]) -> Callable[[RunConfig], float]:
    """A `bound` for search(): tokens/s at the least step time the time model can predict for the layout on the
    calibration `calibration(cfg)` gives it (the one its score uses)."""
    def bound(cfg: RunConfig) -> float:
        return tokens_per_step(cfg) / calibrated_min_step_seconds(cfg, calibration(cfg))
    return bound
