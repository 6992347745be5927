"""Model FLOPs per step under the two conventions in use, and MFU.

"megatron": Megatron-LM's `num_floating_point_operations` (megatron/training/training.py) for dense GQA models,
per global batch of B sequences of length s. Every GEMM counts 2mnk (FMA) x 3 (forward, wgrad, dgrad):
    6 B s [ g h f L  +  L (h (q + 2 kv) + q h)  +  h V ]  +  6 B s^2 q L
with q = n_q d (query projection width), kv = n_kv d, V the padded vocab, g the MLP's f x h GEMMs: 3 under SwiGLU
(gate, up, down; Megatron's gated_linear_multiplier 3/2 on its 2 h f), 2 for the GeLU MLP (multiplier 1); the QKV
and output projections, the logit GEMM (tied or not: the GEMM runs either way); the core attention QK^T and
(softmax)V cost 2 x 2 B s^2 q forward, halved by the causal mask. Norms, RoPE, softmax, biases, position embeddings
and activation recompute are not counted.
Mixture of experts (Megatron's moe_layer term): each token runs k experts of f_moe, so the MLP term g h f becomes
g h f_moe k. The router's [E, h] GEMM (2 h E per token per layer forward) is left out, as Megatron's count leaves it
out, so that "megatron" stays Megatron's number (it is under 0.1% of a layer at E = 8; palm_6n counts the router's
weights among the active parameters). Dropped assignments are still counted (model FLOPs of the routing asked for),
as Megatron.
"palm_6n": PaLM (Chowdhery et al. 2022, app. B) as torchtitan computes it, per token:
    6 (N - N_embedding) + 12 L q s
with no causal halving and N - N_embedding the parameters that are GEMM weights (biases and norms count in N, as
torchtitan counts every parameter): N_embedding is the input embedding's own matrix, a lookup, and a learned
position table, another lookup. Tied, the word matrix is also the logit GEMM's weight, so nothing is left out
(torchtitan's literal count, deduplicated parameters minus nn.Embedding's, would drop the logit GEMM that still runs);
the figure is the same tied or untied, as Megatron's. For an MoE model N is the parameters a token passes through:
the dense ones and k of the E experts per layer (params.active_params).
Under --fp8-format the layers' linears run in fp8 (the embedding, output layer and core attention do not): their
share, 6 B s L (g h f + h (q + 2 kv) + q h), is the same in both conventions (fp8_flops_per_step), and MFU is also
stated against the fp8 dense peak (ledger/reconcile/throughput.py).
"""
from __future__ import annotations

from common.config import RunConfig
from common.errors import ConfigError
from common.ops.sizes import padded_vocab
from ledger.models.formulas.params import active_params, component_counts

H200_BF16_DENSE_PEAK = 989e12
H200_FP8_DENSE_PEAK = 1979e12  # NVIDIA H200 datasheet: 3,958 TFLOP/s fp8 with sparsity
MEGATRON = ("megatron: num_floating_point_operations (GQA, SwiGLU 3 or GeLU 2 MLP GEMMs, causal-halved attention; "
            "MoE: k experts of f_moe per token), per global batch")
PALM_6N = "palm_6n: 6(N - N_embedding) + 12*L*q*s per token (PaLM / torchtitan), x tokens per global batch"


def tokens_per_step(cfg: RunConfig) -> int:
    return cfg.train.global_batch_size * cfg.model.seq_length


def _layer_linear_weights(cfg: RunConfig) -> int:
    """A layer's GEMM weights a token passes through: MLP (g h f, or k experts' 3 h f_moe) and QKV and projection."""
    m = cfg.model
    h, q, kv = m.hidden_size, m.num_attention_heads * m.head_dim, m.kv_channels
    mlp = (3 if m.swiglu else 2) * h * m.ffn_hidden_size
    if m.is_moe:  # k SwiGLU experts of f_moe per token (the router left out, as Megatron: module docstring)
        mlp = 3 * h * m.expert_ffn_hidden_size * m.moe_router_topk
    return mlp + h * (q + 2 * kv) + q * h


def megatron_flops_per_step(cfg: RunConfig) -> int:
    m = cfg.model
    h, L, s = m.hidden_size, m.num_layers, m.seq_length
    q = m.num_attention_heads * m.head_dim
    vocab = padded_vocab(m, cfg.parallel.tensor_model_parallel_size)
    batch = cfg.train.global_batch_size
    linear = _layer_linear_weights(cfg) * L + h * vocab
    return 6 * batch * s * linear + 6 * batch * s * s * q * L


def fp8_flops_per_step(cfg: RunConfig) -> int:
    """What of either convention's count runs in fp8: the layers' linears under --fp8-format (and the logit GEMM
    under --fp8-output-layer), else nothing."""
    impl, m = cfg.implementation, cfg.model
    if not impl.fp8:
        return 0
    vocab = padded_vocab(m, cfg.parallel.tensor_model_parallel_size)
    logits = m.hidden_size * vocab if impl.fp8_output_layer else 0
    return 6 * tokens_per_step(cfg) * (_layer_linear_weights(cfg) * m.num_layers + logits)


def palm_flops_per_token(cfg: RunConfig) -> int:
    m = cfg.model
    counts = component_counts(m, cfg.parallel.tensor_model_parallel_size)
    lookup_only = counts["embedding"] if m.untie_embeddings_and_output_weights else 0  # tied: also the logit GEMM's
    lookup_only += counts.get("position_embedding", 0)
    q = m.num_attention_heads * m.head_dim
    return 6 * (active_params(cfg) - lookup_only) + 12 * m.num_layers * q * m.seq_length


def mfu(flops_per_step: float, step_seconds: float, num_gpus: int, peak_flops: float = H200_BF16_DENSE_PEAK) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the peak of all GPUs doing the step."""
    if step_seconds <= 0 or num_gpus < 1 or peak_flops <= 0:
        raise ConfigError("MFU needs a positive step time, peak and GPU count")
    return flops_per_step / (step_seconds * num_gpus * peak_flops)
