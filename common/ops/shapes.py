"""One rank's shapes of one micro-batch, from the run's config: what every catalogue entry's dims are made of.

Widths are local to the TP rank, tokens to the CP rank (seq = s / C); `tokens` = seq b are the GEMMs' rows
(all-gathered under SP), `norm_tokens` = seq b / t under SP the norms' and residual adds' rows. An MoE layer's
ExpertShapes: its T routed tokens, the R kept assignments under uniform routing and each local expert's rows (or,
under --moe-grouped-gemm, the rows the grouped GEMMs run over).
`megatron`: Megatron-LM's own layers (common/config ImplementationConfig), whose kernels differ where MegatronOps
says (megatron.py); None for this engine's.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.config import RunConfig
from common.config.implementation_config import FOREACH_ADAM
from common.ops.sizes import (
    DTYPE_BYTES,
    expert_capacity,
    fc1_width,
    fused_softmax,
    local_seq_length,
    padded_rows,
    routed_tokens,
    uniform_kept_assignments,
    vocab_shard,
)


@dataclass(frozen=True)
class ExpertShapes:
    """One micro-batch's MoE layer on one rank under uniform routing: `tokens` routed (T), `routed` kept assignments
    (R: permuted rows, sent and, every rank alike, received), `rows` each local expert's GEMMs run at (R split as
    evenly as it goes, padded under --moe-pad-expert-rows), widths local to the TP rank; the router's options that
    change its kernels."""
    experts: int  # E, global
    topk: int
    tokens: int
    routed: int
    rows: tuple[int, ...]
    ffn: int  # f_moe / t
    ep: int
    aux_loss: int  # 1 with a load-balancing loss (its softmax over all E), else 0
    dropping: int  # 1 with a capacity factor (the drop policy's sorts), else 0
    capacity: int | None = None  # assignments an expert keeps of the rank's micro-batch (None: all)
    grouped: bool = False  # --moe-grouped-gemm: each expert linear one grouped GEMM over `grouped_rows`
    # --moe-delay-expert-wgrad: the micro-batches each expert weight's one wgrad GEMM a step runs over (None: a wgrad
    # in every backward)
    delayed_wgrad_microbatches: int | None = None

    @classmethod
    def of(cls, cfg: RunConfig) -> "ExpertShapes | None":
        m = cfg.model
        if not m.is_moe:
            return None
        ep = cfg.parallel.expert_model_parallel_size
        tokens = routed_tokens(cfg)
        routed = uniform_kept_assignments(tokens, m)
        each, extra = divmod(routed, m.num_experts // ep)
        return cls(experts=m.num_experts, topk=m.moe_router_topk, tokens=tokens, routed=routed,
                   rows=tuple(padded_rows(each + (i < extra), m.moe_pad_expert_rows)
                              for i in range(m.num_experts // ep)),
                   ffn=m.expert_ffn_hidden_size // cfg.parallel.tensor_model_parallel_size, ep=ep,
                   aux_loss=int(m.moe_aux_loss_coeff > 0), dropping=int(m.moe_expert_capacity_factor is not None),
                   capacity=expert_capacity(tokens, m), grouped=m.moe_grouped_gemm,
                   delayed_wgrad_microbatches=cfg.num_microbatches if m.moe_delay_expert_wgrad else None)

    @property
    def fc1(self) -> int:
        return 2 * self.ffn  # SwiGLU experts: gate and up

    @property
    def local_experts(self) -> int:
        return len(self.rows)

    @property
    def grouped_rows(self) -> int:
        """The rows a grouped GEMM runs over: at EP 1 every assignment (the counts stay on the device, so the
        dropped rows are carried, zeroed), under EP > 1 the kept ones received."""
        return self.tokens * self.topk if self.ep == 1 else self.routed

    @property
    def row_counts(self) -> tuple[int, ...]:
        """The distinct row counts of the rank's experts (one or two), none empty."""
        return tuple(sorted({r for r in self.rows if r > 0}))

    @property
    def delayed_wgrad_rows(self) -> tuple[int, ...]:
        """Under --moe-delay-expert-wgrad, the rows of each distinct expert's one wgrad GEMM a step: its rows in
        every micro-batch (none otherwise)."""
        m = self.delayed_wgrad_microbatches
        return tuple(m * r for r in self.row_counts) if m else ()


@dataclass(frozen=True)
class MegatronKernels:
    """Which of Megatron-LM's unfused paths a rank runs (common/ops/megatron.py prices each)."""
    unfused_attention: bool  # DotProductAttention: batched GEMMs and the masked softmax on [b, heads, s, s]
    softmax_fp32: bool
    repeat_kv: bool  # K and V repeated to every head (unfused attention under GQA)
    unfused_rope: bool
    unfused_swiglu: bool
    foreach_optimizer: bool  # torch's AdamW (foreach)
    fused_softmax: bool = False  # the unfused attention's softmax in Megatron's fused scale-mask-softmax kernel

    @classmethod
    def of(cls, cfg: RunConfig) -> "MegatronKernels | None":
        impl, m = cfg.implementation, cfg.model
        if not impl.megatron:
            return None
        unfused = impl.unfused_attention
        fused = unfused and fused_softmax(cfg)
        return cls(unfused_attention=unfused, fused_softmax=fused,
                   softmax_fp32=unfused and impl.attention_softmax_in_fp32 and not fused,
                   repeat_kv=unfused and m.num_attention_heads > m.num_query_groups,
                   unfused_rope=not impl.apply_rope_fusion and not m.learned_positions,
                   unfused_swiglu=m.swiglu and not impl.bias_swiglu_fusion,
                   foreach_optimizer=impl.optimizer_impl == FOREACH_ADAM)


@dataclass(frozen=True)
class Shapes:
    """One micro-batch's TP-local dims on one CP rank (module docstring)."""
    dtype: str
    seq: int
    micro_batch: int
    hidden: int
    tokens: int
    norm_tokens: int
    heads: int
    kv_heads: int
    head_dim: int
    qkv: int
    query: int
    ffn: int
    fc1: int  # linear_fc1's width: 2 ffn under SwiGLU, ffn for GeLU
    swiglu: bool
    rope: bool
    norm: str  # the norm kernels' name: rms_norm | layer_norm
    vocab: int
    tp: int
    sequence_parallel: bool
    cp: int = 1
    moe: ExpertShapes | None = None  # None for a dense MLP
    grad_dtype: str = "fp32"  # the main grads' (DDP's grad buffers)
    linear_cross_entropy: bool = False  # the loss fused with the output layer over chunks (recomputes the logits)
    megatron: MegatronKernels | None = None  # Megatron-LM's layers; None: this engine's
    fp8: bool = False  # --fp8-format: the layer linears' GEMMs in fp8 (common/ops/linear.py)
    fp8_output_layer: bool = False  # --fp8-output-layer: the output layer's too
    fused_attention: bool = False  # the engine's --attention-backend fused: cuDNN's kernel (common/ops/attention.py)
    embedding_into_main_grad: bool = False  # the lookup's backward adds its rows into main_grad (no dense gradient)
    # no gradient-accumulation fusion (--no-gradient-accumulation-fusion, ours or Megatron-LM's): each linear's
    # 16-bit wgrad, then DDP's hook adds it into main_grad
    unfused_wgrad: bool = False

    @classmethod
    def of(cls, cfg: RunConfig) -> "Shapes":
        m, p = cfg.model, cfg.parallel
        t, b, s = p.tensor_model_parallel_size, cfg.train.micro_batch_size, local_seq_length(cfg)
        d = m.head_dim
        return cls(dtype=cfg.train.params_dtype, seq=s, micro_batch=b, hidden=m.hidden_size, tokens=s * b,
                   norm_tokens=s * b // (t if p.sequence_parallel else 1), heads=m.num_attention_heads // t,
                   kv_heads=m.num_query_groups // t, head_dim=d,
                   qkv=(m.num_attention_heads + 2 * m.num_query_groups) * d // t,
                   query=m.num_attention_heads * d // t, ffn=m.ffn_hidden_size // t, fc1=fc1_width(m) // t,
                   swiglu=m.swiglu, rope=not m.learned_positions, norm="layer_norm" if m.layer_norm else "rms_norm",
                   vocab=vocab_shard(cfg), tp=t,
                   sequence_parallel=p.sequence_parallel, cp=p.context_parallel_size, moe=ExpertShapes.of(cfg),
                   grad_dtype=cfg.train.grad_dtype, linear_cross_entropy=m.linear_cross_entropy,
                   megatron=MegatronKernels.of(cfg), fp8=cfg.implementation.fp8,
                   fp8_output_layer=cfg.implementation.fp8_output_layer,
                   fused_attention=cfg.implementation.fused_attention and not cfg.implementation.megatron,
                   embedding_into_main_grad=(cfg.implementation.embedding_gradient_accumulation_fusion
                                             and not cfg.implementation.megatron),
                   unfused_wgrad=not cfg.implementation.gradient_accumulation_fusion)

    @property
    def activation_bytes(self) -> int:
        """The full [s, b, h] activation: every TP collective's nccl-tests size."""
        return DTYPE_BYTES[self.dtype] * self.tokens * self.hidden

    @property
    def kv_block_bytes(self) -> int:
        """|KV|: this rank's K and V blocks, [s/C, b, n_kv/t, d] each (comm.kv_block_bytes)."""
        return 2 * DTYPE_BYTES[self.dtype] * self.tokens * self.kv_heads * self.head_dim
