"""The most tokens/s a layout can reach: cheap upper bounds that let the layout search skip the full step replay of
layouts that cannot reach its top K. Two, from the same chain (below): `tokens_per_s_bound` from FLOPs at a given
peak (needs nothing but the peak; loose, as no kernel runs at it), `calibrated_bound` from the time model's own
prices of the same ops (tight: the compute alone, at the kernel times the replay uses).

Only the GEMMs and core attention count, at the GPU's peak (no kernel runs faster than the peak; everything else a
step does only adds time), per micro-batch on one TP rank of each stage, Megatron's convention (ledger/models/formulas/
flops.py) split by stage: a layer's forward 2 s b [g h f + h (q + 2 kv) + q h] / t + 2 s^2 b q / t (g = 3 SwiGLU, 2
GeLU; causal attention halved), its backward twice that (the time model's attention backward is 2.5x: more, so still
a bound), recompute adding the core attention's forward (selective) or the whole layer's forward (full), and the last
stage the logit GEMM, 2 s b V h / t forward and twice that backward.

The step then takes at least (any schedule, ledger/models/schedule.py):
- every stage's own work, m micro-batches of its forward and backward (f_s + b_s), and
- the dependency chain through the pipeline: the first micro-batch's forward of model chunk 0 through stages 0 .. p-2
  (a chunk being 1/v of a stage's layers), all of the last stage's work, then the last micro-batch's backward of
  chunk 0 back through stages p-2 .. 0:  sum_{s < p-1} (f_s + b_s) / v (layers only)  +  m (f_{p-1} + b_{p-1}).
tokens/s <= global batch x seq / that time.

`calibrated_bound` prices each model chunk's forward and backward as ledger.models.time_model.compute does, but from one
layer's ops (ledger/models/time_model/ops.py) times the chunk's layers plus its ends, so an 80-layer model costs no more than
a 1-layer one: the same seconds each item of the replay (ledger.models.time_model.step) lasts before any wait, P2P transfer
or gather is added. With the schedule's last item on every stage the backward of micro-batch m, chunk 0
(ledger/models/schedule.py), the chain above is one of the replay's dependency paths; the step then adds at least the
optimizer step of the stage that owns the most parameter elements.
"""
from __future__ import annotations

from collections.abc import Callable

from common.config import RunConfig
from ledger.models.formulas.activations import checkpoint_groups, layers_per_chunk
from ledger.models.formulas.flops import tokens_per_step
from ledger.models.formulas.params import num_chunks, padded_vocab_size
from ledger.models.formulas.static_memory import owned_per_dp_rank
from ledger.models.time_model import ops
from ledger.models.time_model.calibration import Calibration
from ledger.models.time_model.compute import price


def _layer_flops(cfg: RunConfig) -> tuple[float, float]:
    """(forward, backward with recompute) FLOPs of one layer, one micro-batch, one TP rank."""
    m, t = cfg.model, cfg.parallel.tensor_model_parallel_size
    s, b, h, f = m.seq_length, cfg.train.micro_batch_size, m.hidden_size, m.ffn_hidden_size
    q, kv = m.num_attention_heads * m.head_dim, m.kv_channels
    gemms = 2 * s * b * ((3 if m.swiglu else 2) * h * f + h * (q + 2 * kv) + q * h) / t
    attention = 2 * s * s * b * q / t
    recompute = {"selective": attention, "full": gemms + attention}.get(cfg.recompute.recompute_granularity, 0.0)
    return gemms + attention, 2 * (gemms + attention) + recompute


def min_step_seconds(cfg: RunConfig, peak_flops: float) -> float:
    """The least time a step can take at `peak_flops` per GPU (module docstring)."""
    p, v, m = cfg.parallel.pipeline_model_parallel_size, num_chunks(cfg), cfg.num_microbatches
    forward, backward = _layer_flops(cfg)
    layers = cfg.model.num_layers // p
    per_stage = [layers * (forward + backward) / peak_flops] * p
    vocab = padded_vocab_size(cfg.model.vocab_size, cfg.model.make_vocab_size_divisible_by,
                              cfg.parallel.tensor_model_parallel_size)
    logits = 2 * cfg.model.seq_length * cfg.train.micro_batch_size * vocab * cfg.model.hidden_size
    per_stage[-1] += 3 * logits / cfg.parallel.tensor_model_parallel_size / peak_flops
    chain = sum(per_stage[:-1]) / v + m * per_stage[-1]
    return max(chain, m * max(per_stage))


def tokens_per_s_bound(peak_flops: float) -> Callable[[RunConfig], float]:
    """A `bound` for search(): tokens/s no layout can beat on GPUs of this dense peak (of the run's dtype)."""
    def bound(cfg: RunConfig) -> float:
        return tokens_per_step(cfg) / min_step_seconds(cfg, peak_flops)
    return bound


def chunk_seconds(cfg: RunConfig, cal: Calibration) -> list[list[tuple[float, float]]]:
    """(forward, backward) seconds of one micro-batch through each chunk of each stage, as compute.stage_time prices
    them, from one layer's ops: the chunk's layers x one layer, its recompute groups, its ends."""
    sh = ops.Shapes.of(cfg)
    prefix = "decoder.layers.0."
    layer_f = price(ops.layer_forward(sh, prefix), cfg, cal, forward=True).seconds
    layer_b = price(ops.layer_backward(sh, prefix, cfg.recompute.recompute_granularity == "selective"), cfg, cal,
                    forward=False).seconds
    rerun: dict[int, float] = {}
    for g, checkpointed in checkpoint_groups(cfg):
        if checkpointed and g not in rerun:
            rerun[g] = price(ops.recomputed(sh, list(range(g))), cfg, cal, forward=False).seconds
    layers = layers_per_chunk(cfg)
    body_f = layers * layer_f
    body_b = layers * layer_b + sum(rerun[g] for g, checkpointed in checkpoint_groups(cfg) if checkpointed)
    out = []
    for s in range(cfg.parallel.pipeline_model_parallel_size):
        chunks = []
        for c in range(num_chunks(cfg)):
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
    optimizer = max(cal.rate_seconds("optimizer.step", dtype, max(owned_per_dp_rank(cfg, s)))
                    for s in range(cfg.parallel.pipeline_model_parallel_size))
    return max(chain, max(work)) + optimizer


def calibrated_bound(calibration: Callable[[RunConfig], Calibration]) -> Callable[[RunConfig], float]:
    """A `bound` for search(): tokens/s at the least step time the time model can predict for the layout on the
    calibration `calibration(cfg)` gives it (the one its score uses)."""
    def bound(cfg: RunConfig) -> float:
        return tokens_per_step(cfg) / calibrated_min_step_seconds(cfg, calibration(cfg))
    return bound
