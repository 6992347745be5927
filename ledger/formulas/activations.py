"""Activation memory: the tensors our layer saves for backward, per layer, per micro-batch, per stage.

Derivation in docs/formulas.md ("Activations"). Sequence-first [s, b, h] layout, activations in the params' dtype
(2 bytes under --bf16, 4 in fp32), no dropout (so no masks), flash / SDPA attention (saves q, k, v, the output and
an fp32 logsumexp; no s^2 term), fused SwiGLU (saves the fc1 output only), fused RMSNorm (saves its input and an
fp32 rstd per token), RoPE saving nothing per layer, the attention output doubling as linear_proj's input. Under
sequence parallelism Megatron saves the sequence-sharded input of linear_qkv / linear_fc1 and re-gathers it in
backward, so every [s, b, h] tensor is divided by t; without it those are replicated on each TP rank.

Per layer, t = 1, a = activation bytes, r = n_kv / n_q:  a*sbh(6 + 2r) + 3a*sbf + 8sb + 4*b*n_q*s,
37 sbh (+ small) for the llama3.2-1b shape in bf16, against Korthikanti et al. 2022's sbh(34 + 5as/h).

In flight (Megatron's schedules): 1F1B stage i holds min(p - i, m) micro-batches; interleaved stage i holds
min(2(p - i - 1) + (v - 1)p + 1, m v) chunk-micro-batches of L / (p v) layers each, which for stage 0 is
Megatron's (1 + (p - 1)/(p v)) x p micro-batches' worth of its layers (theoretical_memory_usage.py).
Full recompute (uniform, one layer a checkpoint) keeps each layer's input and, in backward, one layer's full set.
"""
from __future__ import annotations

from common.config import RunConfig
from common.errors import ConfigError
from ledger.formulas.bytes_per_param import DTYPE_BYTES
from ledger.formulas.params import num_chunks, padded_vocab_size

RECOMPUTE = ("none", "full")


def activation_bytes(cfg: RunConfig) -> int:
    return DTYPE_BYTES[cfg.train.params_dtype]


def _sp_div(cfg: RunConfig) -> int:
    """Divisor of the [s, b, h] tensors outside the TP-split regions: t under sequence parallelism, else 1."""
    return cfg.parallel.tensor_model_parallel_size if cfg.parallel.sequence_parallel else 1


def layer_saved_tensors(cfg: RunConfig) -> dict[str, int]:
    """Bytes each saved tensor of one layer takes on one TP rank for one micro-batch."""
    m, t = cfg.model, cfg.parallel.tensor_model_parallel_size
    s, b, h, f = m.seq_length, cfg.train.micro_batch_size, m.hidden_size, m.ffn_hidden_size
    q, kv = m.num_attention_heads * m.head_dim, m.kv_channels
    a, sp = activation_bytes(cfg), _sp_div(cfg)
    return {
        "input_layernorm.input": a * s * b * h // sp,
        "input_layernorm.rstd": 4 * s * b // sp,
        "linear_qkv.input": a * s * b * h // sp,
        "attention.q": a * s * b * q // t,
        "attention.k": a * s * b * kv // t,
        "attention.v": a * s * b * kv // t,
        "attention.output=linear_proj.input": a * s * b * q // t,
        "attention.logsumexp": 4 * b * (m.num_attention_heads // t) * s,
        "pre_mlp_layernorm.input": a * s * b * h // sp,
        "pre_mlp_layernorm.rstd": 4 * s * b // sp,
        "linear_fc1.input": a * s * b * h // sp,
        "swiglu.input=linear_fc1.output": a * s * b * 2 * f // t,
        "linear_fc2.input": a * s * b * f // t,
    }


def layer_bytes(cfg: RunConfig, recompute: str = "none") -> int:
    """Saved bytes of one layer for one micro-batch while it waits for its backward."""
    if recompute not in RECOMPUTE:
        raise ConfigError(f"unknown recompute option {recompute!r} (one of {', '.join(RECOMPUTE)})")
    if recompute == "full":
        m = cfg.model
        return activation_bytes(cfg) * m.seq_length * cfg.train.micro_batch_size * m.hidden_size // _sp_div(cfg)
    return sum(layer_saved_tensors(cfg).values())


def first_stage_extra_bytes(cfg: RunConfig) -> int:
    """The embedding saves only its int64 token ids (its output is the first layer's saved input)."""
    return 8 * cfg.model.seq_length * cfg.train.micro_batch_size


def last_stage_extra_bytes(cfg: RunConfig) -> int:
    """Final norm input + rstd, output layer input, and Megatron's vocab-parallel cross-entropy: fp32 softmax over
    the local vocab slice, a bool target mask and int64 masked targets per token."""
    m, t = cfg.model, cfg.parallel.tensor_model_parallel_size
    s, b = m.seq_length, cfg.train.micro_batch_size
    a, sp = activation_bytes(cfg), _sp_div(cfg)
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, t)
    return (2 * a * s * b * m.hidden_size // sp + 4 * s * b // sp
            + 4 * s * b * vocab // t + s * b * (1 + 8))


def logits_transient_bytes(cfg: RunConfig) -> int:
    """The 16/32-bit logits (forward) or their gradient (backward) beside the saved fp32 softmax on the last stage:
    live only around the loss, so counted in the peak but not in the saved activations."""
    m, t = cfg.model, cfg.parallel.tensor_model_parallel_size
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, t)
    return activation_bytes(cfg) * m.seq_length * cfg.train.micro_batch_size * vocab // t


def in_flight(cfg: RunConfig, pp_rank: int) -> int:
    """Chunk-micro-batches whose activations stage `pp_rank` holds at its peak (see module docstring)."""
    p, v, m = cfg.parallel.pipeline_model_parallel_size, num_chunks(cfg), cfg.num_microbatches
    if p == 1:
        return 1
    if v == 1:
        return min(p - pp_rank, m)
    return min(2 * (p - pp_rank - 1) + (v - 1) * p + 1, m * v)


def stage_activation_bytes(cfg: RunConfig, pp_rank: int, recompute: str = "none") -> int:
    """Peak saved activations on one TP rank of pipeline rank `pp_rank`."""
    p, v = cfg.parallel.pipeline_model_parallel_size, num_chunks(cfg)
    layers_per_chunk = cfg.model.num_layers // (p * v)
    total = in_flight(cfg, pp_rank) * layers_per_chunk * layer_bytes(cfg, recompute)
    if recompute == "full":
        total += layer_bytes(cfg, "none")
    if pp_rank == 0:
        total += min(p, cfg.num_microbatches) * first_stage_extra_bytes(cfg)
    if pp_rank == p - 1:
        total += last_stage_extra_bytes(cfg)
    return total


def korthikanti_layer_bytes(s: int, b: int, h: int, heads: int, tp: int = 1, sequence_parallel: bool = False) -> float:
    """Korthikanti et al. 2022 (Table 2), 16-bit activations with dropout and unfused softmax attention:
    sbh(34 + 5as/h); TP: sbh(10 + 24/t + 5as/(ht)); TP + SP: sbh(34/t + 5as/(ht))."""
    quadratic = 5 * heads * s / (h * tp)
    if sequence_parallel:
        return s * b * h * (34 / tp + quadratic)
    return s * b * h * (10 + 24 / tp + quadratic)
