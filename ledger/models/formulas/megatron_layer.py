"""What Megatron-LM's own TransformerLayer keeps for backward, on one TP rank for one micro-batch: its local spec
(--transformer-impl local: ColumnParallelLinear, RowParallelLinear, torch's norms, unfused RoPE, DotProductAttention)
or a flash core attention in its place (Transformer Engine's, or runs/megatron/megatron_sdpa_spec.py's).

Three parts, in the order the layer runs them, because the peak's phases (peak_phases.py) hold some and not others:
  before_core   the input norm's input and statistics, linear_qkv's input, RoPE's cos and sin (unfused: one pair
                per call, for q and for k), and the q, k and v that core attention keeps: q as RoPE made it (or, under
                GQA, the reshape's copy), k as RoPE made it, K and V repeated to every head (repeat_interleave) for
                unfused attention under GQA, else v (and q, k without RoPE) a view that keeps the QKV projection's
                whole output
  core          core_attention.saved_tensors
  after_core    the residual's dropout mask, the pre-MLP norm, linear_fc1's input, the activation's saved tensors
                (unfused SwiGLU: fc1's output through silu's view of it, silu's output and the up half plus
                Megatron's glu_linear_offset, a new tensor; --bias-swiglu-fusion: fc1's output only), linear_fc2's
                input, the MLP residual's dropout mask
docs/formulas.md, "Megatron-LM's saved set"; tests/test_megatron_memory.py holds every term to what Megatron-LM's
code keeps (its saved-tensor hooks on the real modules, listed there).
"""
from __future__ import annotations

from common.config import RunConfig
from common.ops.sizes import DTYPE_BYTES, fc1_width, local_seq_length
from ledger.models.formulas import core_attention

FP32 = 4


def _sizes(cfg: RunConfig) -> tuple[int, int, int, int]:
    """(activation bytes, tokens, sequence-parallel divisor, tp)."""
    t = cfg.parallel.tensor_model_parallel_size
    sp = t if cfg.parallel.sequence_parallel else 1
    return DTYPE_BYTES[cfg.train.params_dtype], local_seq_length(cfg) * cfg.train.micro_batch_size, sp, t


def norm_saved(cfg: RunConfig, name: str) -> dict[str, int]:
    """A fused norm (torch's, or this engine's): its input and fp32 statistics per token (rstd; and the mean for
    LayerNorm), sequence-sharded under SP."""
    a, tokens, sp, _ = _sizes(cfg)
    stats = ("mean", "rstd") if cfg.model.layer_norm else ("rstd",)
    return {f"{name}.input": a * tokens * cfg.model.hidden_size // sp,
            **{f"{name}.{stat}": FP32 * tokens // sp for stat in stats}}


def before_core(cfg: RunConfig) -> dict[str, int]:
    m, impl = cfg.model, cfg.implementation
    a, tokens, sp, t = _sizes(cfg)
    q, kv, qkv = (m.num_attention_heads * m.head_dim // t, m.kv_channels // t,
                  (m.num_attention_heads + 2 * m.num_query_groups) * m.head_dim // t)
    rope = not m.learned_positions
    gqa = m.num_attention_heads > m.num_query_groups
    saved = {**norm_saved(cfg, "input_layernorm"), "linear_qkv.input": a * tokens * m.hidden_size // sp}
    if rope and not impl.apply_rope_fusion:
        saved["rope.cos_sin"] = 4 * a * local_seq_length(cfg) * m.head_dim
    if rope or gqa:  # RoPE's output, or under GQA the reshape's copy of the query heads
        saved["attention.q"] = a * tokens * q
    if impl.unfused_attention and gqa:
        return saved | {"attention.k_repeated": a * tokens * q, "attention.v_repeated": a * tokens * q}
    if rope:
        saved["attention.k"] = a * tokens * kv
    return saved | {"linear_qkv.output (kept by the v view)": a * tokens * qkv}


def after_core(cfg: RunConfig) -> dict[str, int]:
    m, impl = cfg.model, cfg.implementation
    a, tokens, sp, t = _sizes(cfg)
    f, fc1 = m.ffn_hidden_size // t, fc1_width(m) // t
    dropout = ({"self_attn_bda.dropout_mask[bool]": tokens * m.hidden_size // sp} if impl.hidden_dropout > 0
               else {})
    saved = {**dropout, **norm_saved(cfg, "pre_mlp_layernorm"), "linear_fc1.input": a * tokens * m.hidden_size // sp}
    if m.swiglu and not impl.bias_swiglu_fusion:
        saved |= {"linear_fc1.output (silu's input)": a * tokens * fc1, "silu.output": a * tokens * f,
                  "glu.up_plus_offset": a * tokens * f}
    else:
        saved[f"{'swiglu' if m.swiglu else 'gelu'}.input=linear_fc1.output"] = a * tokens * fc1
    saved["linear_fc2.input"] = a * tokens * f
    if impl.hidden_dropout > 0:
        saved["mlp_bda.dropout_mask[bool]"] = tokens * m.hidden_size // sp
    return saved


def saved_tensors(cfg: RunConfig) -> dict[str, int]:
    """The whole layer's saved tensors, under selective recompute without core attention's own (its inputs stay,
    as the checkpoint's, and its output, as linear_proj's input)."""
    core = core_attention.saved_tensors(cfg)
    if cfg.recompute.recompute_granularity == "selective":
        core = {k: v for k, v in core.items() if "linear_proj.input" in k}
    return {**before_core(cfg), **core, **after_core(cfg)}
