"""The model's shape and flavour (Megatron's TransformerConfig and its model flags), and the checks it makes alone."""
from __future__ import annotations

from dataclasses import dataclass

from common.errors import ConfigError

CROSS_ENTROPY_FUSION_IMPLS = ("native", "linear")
# Tokens per chunk of the fused output layer and loss (--cross-entropy-fusion-impl linear): the chunk's logits, not
# the micro-batch's, are what the loss holds at a time (ledger/models/formulas/activations.py counts one chunk).
LINEAR_CROSS_ENTROPY_CHUNK_TOKENS = 1024


@dataclass
class ModelConfig:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    seq_length: int
    max_position_embeddings: int
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-5
    make_vocab_size_divisible_by: int = 128
    init_method_std: float = 0.02
    # Megatron ties the output layer to the input embedding unless --untie-embeddings-and-output-weights.
    untie_embeddings_and_output_weights: bool = False
    # The layer's flavour, Megatron's TransformerConfig. Defaults: the Llama-style model the engine implements (and
    # every manifest written before these fields existed): SwiGLU MLP (--swiglu: fc1 is 2f x h, gate and up), no
    # biases (--disable-bias-linear), RMSNorm, RoPE. A GPT-style model (Megatron's defaults without those flags:
    # fc1 f x h with GeLU, biases, LayerNorm with a bias, learned absolute position embeddings) is for the ledger's
    # formulas only (simulate / search); the engine refuses it.
    swiglu: bool = True
    add_bias_linear: bool = False
    normalization: str = "RMSNorm"  # or "LayerNorm" (a weight and a bias)
    position_embedding_type: str = "rope"  # or "learned_absolute" (a max_position_embeddings x h table)
    # Mixture of experts, Megatron's --num-experts and --moe-* flags (docs/engine.md, "Mixture of experts"). None is
    # the dense model; with experts every layer's MLP is an MoE layer (Megatron's default --moe-layer-freq 1): a
    # router (h -> E logits, top-k, softmax over the k chosen) and E SwiGLU experts of width moe_ffn_hidden_size.
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None  # each expert's f; None: --ffn-hidden-size, as Megatron
    moe_aux_loss_coeff: float = 0.0  # the load-balancing loss's weight (Switch Transformer's alpha)
    moe_expert_capacity_factor: float | None = None  # None: no capacity, no token dropped
    # Megatron's --moe-grouped-gemm: the rank's experts run as one grouped GEMM per linear over rows grouped by expert,
    # with the per-expert row counts left on the device (docs/engine.md, "Mixture of experts"); without it each
    # expert's MLP runs on its own rows (SequentialMLP), whose sizes the host reads every layer.
    moe_grouped_gemm: bool = False
    # This engine's --moe-pad-expert-rows N (SequentialMLP): each expert's rows padded with zero rows up to a multiple
    # of N, so its GEMMs run at a few row counts: cuBLAS picks a kernel on the host the first time it sees a shape,
    # at some small row counts in milliseconds (docs/engine.md, "Mixture of experts"). None: no padding.
    moe_pad_expert_rows: int | None = None
    # This engine's --moe-delay-expert-wgrad (SequentialMLP): each expert linear's weight gradient computed once a
    # step, over every micro-batch's rows, instead of once per micro-batch into the fp32 main_grad: one GEMM with a
    # long reduction instead of m short ones that each read and write the whole gradient. Its operands are held from
    # each micro-batch's backward to the step's end (docs/engine.md, "Mixture of experts").
    moe_delay_expert_wgrad: bool = False
    # Megatron's --cross-entropy-loss-fusion and --cross-entropy-fusion-impl. The engine's loss is always its fused
    # vocab-parallel cross entropy over the output layer's whole [s, b, V/t] logits ("native"); "linear" (with the
    # fusion on) fuses the output layer into the loss over chunks of tokens, so no [s, b, V/t] tensor is ever held,
    # at the price of the output layer's forward GEMM again in backward (docs/engine.md, "Output layer and loss").
    cross_entropy_loss_fusion: bool = False
    cross_entropy_fusion_impl: str = "native"

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn_hidden_size

    @property
    def linear_cross_entropy(self) -> bool:
        """The output layer and the loss fused over chunks of tokens (--cross-entropy-fusion-impl linear)."""
        return self.cross_entropy_loss_fusion and self.cross_entropy_fusion_impl == "linear"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        """Width of the K (or V) projection: query groups x head dim (GQA)."""
        return self.num_query_groups * self.head_dim

    @property
    def layer_norm(self) -> bool:
        """LayerNorm (a bias beside the weight, and a mean saved per token) rather than RMSNorm."""
        return self.normalization == "LayerNorm"

    @property
    def learned_positions(self) -> bool:
        return self.position_embedding_type == "learned_absolute"

    @property
    def llama_style(self) -> bool:
        """The one flavour the engine implements (see the fields above)."""
        return (self.swiglu and not self.add_bias_linear and self.normalization == "RMSNorm"
                and self.position_embedding_type == "rope")


def check_attention(m: ModelConfig) -> None:
    """Heads split the hidden size, query groups the heads (GQA), whatever the layout."""
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads "
                          f"{m.num_attention_heads}")
    if m.num_attention_heads % m.num_query_groups:
        raise ConfigError(f"--num-attention-heads {m.num_attention_heads} is not divisible by --num-query-groups "
                          f"{m.num_query_groups}")


def check_positions(m: ModelConfig) -> None:
    """The sequence fits the position embeddings (RoPE's table, or the learned one)."""
    if m.seq_length > m.max_position_embeddings:
        raise ConfigError(f"--seq-length {m.seq_length} exceeds --max-position-embeddings "
                          f"{m.max_position_embeddings}")


def check_cross_entropy_fusion(m: ModelConfig) -> None:
    """The implementation is one the engine has, and it takes effect only with the fusion on: Megatron ignores
    --cross-entropy-fusion-impl without --cross-entropy-loss-fusion, here that is an error (a flag with no effect)."""
    if m.cross_entropy_fusion_impl not in CROSS_ENTROPY_FUSION_IMPLS:
        raise ConfigError(f"--cross-entropy-fusion-impl {m.cross_entropy_fusion_impl}: expected "
                          f"{' or '.join(CROSS_ENTROPY_FUSION_IMPLS)}")
    if m.cross_entropy_fusion_impl != "native" and not m.cross_entropy_loss_fusion:
        raise ConfigError(f"--cross-entropy-fusion-impl {m.cross_entropy_fusion_impl} needs "
                          "--cross-entropy-loss-fusion")
