"""Activation memory: the tensors our layer saves for backward, per layer, per micro-batch, per stage, under the
run's activation-recompute mode.

Derivation in docs/formulas.md ("Activations"). Sequence-first [s, b, h] layout, activations in the params' dtype
(2 bytes under --bf16, 4 in fp32), no dropout (so no masks), flash / SDPA attention (saves q, k, v, the output and
an fp32 logsumexp; no s^2 term), fused SwiGLU (saves the fc1 output only), fused RMSNorm (saves its input and an
fp32 rstd per token), RoPE saving nothing per layer, the attention output doubling as linear_proj's input. Under
sequence parallelism Megatron saves the sequence-sharded input of linear_qkv / linear_fc1 and re-gathers it in
backward, so every [s, b, h] tensor is divided by t; without it those are replicated on each TP rank.

Per layer, t = 1, a = activation bytes, r = n_kv / n_q:  a*sbh(6 + 2r) + 3a*sbf + 8sb + 4*b*n_q*s,
37 sbh (+ small) for the llama3.2-1b shape in bf16, against Korthikanti et al. 2022's sbh(34 + 5as/h).

The GPT style (ModelConfig, formulas only) as Megatron Core's MLP and layers save it: the GeLU MLP saves 2a*sbf
instead of 3a*sbf: fc1's output [s, b, f/t] (bias_gelu_impl's GeLUFunction saves its input and the bias, a
parameter; without biases F.gelu saves the same input) and the GeLU output as linear_fc2's input. Biases save
nothing more (column-parallel biases are fused into the GeLU, row-parallel ones added in bias_dropout_add, which at
dropout 0 keeps no mask). LayerNorm saves an fp32 mean per token beside rstd (4sb more per norm). Learned positions:
the first stage saves the int64 position ids the table lookup indexes with (8sb), and no RoPE.

Context parallelism (C = --context-parallel-size; Megatron's causal load balancing gives each CP rank chunks i and
2C-1-i of 2C, so s/C tokens): every saved tensor above has its sequence dim at s/C, the attention's included.
Transformer Engine's ring attention (AttnFuncWithCPAndKVP2P, Megatron's default cp_comm_type p2p) saves q, the
K/V block it last received (the same size as the local k and v), the output and the merged fp32 logsumexp
[b, n_q/t, s/C]; the blocks received on the way are freed step by step. So a CP rank's saved bytes are the formulas
above at s/C, exactly 1/C of CP1's for every term (all of them are proportional to s), the stage extras too (token
ids, the final norm, the fp32 softmax of the loss over the rank's s/C tokens).

The loss fused with the output layer over chunks of C_l tokens (--cross-entropy-fusion-impl linear,
engine/fusions/fused_linear_cross_entropy.py) keeps no [s, b, V/t] tensor: two fp32 figures per token instead of the
fp32 softmax, and while its backward runs one chunk's logits and their gradient, 2 a C_l V/t (C_l is a constant
number of tokens, so this term does not shrink with CP once a rank's tokens fill a chunk).

Mixture of experts (docs/formulas.md, "Mixture of experts"): the MLP's three saved tensors give way to what our MoE
layer (engine/transformer/moe) keeps, per micro-batch with T = the rank's tokens, k = top-k, E experts and R = the
rows its experts process (uniform routing: the kept assignments, T k or fewer under a capacity factor,
ledger/models/formulas/moe.py): the router's input a T h (the pre-MLP norm's output, as linear_fc1's input was), the
top-k indices (int64) and softmax over the k chosen (fp32), T k each, and with a load-balancing loss its fp32
softmax over all E experts (T E); the dispatch's row index (int64, R); the experts' fc1 input a R h, SwiGLU input a
R 2f_moe/t and fc2 input a R f_moe/t; the combine's slot index (int64, T k) and its fp32 copy of the expert rows it
weights by the probabilities, 4 T k h (the product's gradient w.r.t. the probabilities needs them). With grouped
expert GEMMs (--moe-grouped-gemm, on a GPU's torch._grouped_mm) the two GEMMs also keep the local experts' weights
as stacked for them, a E/EP 3 f_moe h / t, and the int32 group offsets; at EP 1 the rows are every assignment's, R =
T k (the counts never reach the host, so the dropped rows travel along, zeroed), with a bool mask of the kept ones
under a capacity factor. (The padded-bmm fallback of CPUs and fp32 keeps more: not modelled.)

In flight (Megatron's schedules): 1F1B stage i holds min(p - i, m) micro-batches; interleaved stage i holds
min(2(p - i - 1) + (v - 1)p + 1, m v) chunk-micro-batches of L / (p v) layers each, which for stage 0 is
Megatron's (1 + (p - 1)/(p v)) x p micro-batches' worth of its layers (theoretical_memory_usage.py).

Recompute, per model chunk of n layers and one micro-batch, B = one layer's saved bytes, I = a layer's input
(a sbh, /t under SP):
- none: n B after the forward.
- selective (Megatron's core-attention checkpoint): n (B - logsumexp). The checkpointed SDPA call's q, k, v stay
  alive as the checkpoint's inputs and its output as linear_proj's saved input; only the fp32 logsumexp goes.
- full: the chunk is cut into groups (uniform N: N consecutive layers each, the last shorter; block N: each of the
  first min(N, n) layers alone, the rest plain); a checkpointed group of g layers keeps I, a plain one g B.
  Its backward first recomputes the group's whole saved set (g B, its input among it) while the groups before it
  still hold theirs, so the micro-batch being back-propagated peaks at the largest (earlier groups' bytes + g B).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.config import LINEAR_CROSS_ENTROPY_CHUNK_TOKENS, RecomputeConfig, RunConfig
from ledger.models.formulas.bytes_per_param import DTYPE_BYTES
from ledger.models.formulas.moe import uniform_kept_assignments
from ledger.models.formulas.params import num_chunks, padded_vocab_size

NO_RECOMPUTE = RecomputeConfig()
# What a layer no longer keeps under selective recompute (see the module docstring).
SELECTIVE_FREES = ("attention.logsumexp",)


def recompute_label(r: RecomputeConfig) -> str:
    """"none", "selective", or "full uniform N" / "full block N"."""
    if r.recompute_granularity == "full":
        return f"full {r.recompute_method} {r.recompute_num_layers}"
    return r.recompute_granularity or "none"


def with_recompute(cfg: RunConfig, r: RecomputeConfig) -> RunConfig:
    """The same run under another recompute mode: every formula here reads the mode from the config."""
    return dataclasses.replace(cfg, recompute=r)


def comparison_modes(cfg: RunConfig) -> dict[str, RecomputeConfig]:
    """The run's own mode first, then none, selective and full uniform 1 (Megatron's usual full setting)."""
    modes: dict[str, RecomputeConfig] = {}
    for r in (cfg.recompute, NO_RECOMPUTE, RecomputeConfig("selective"), RecomputeConfig("full", "uniform", 1)):
        modes.setdefault(recompute_label(r), r)
    return modes


def activation_bytes(cfg: RunConfig) -> int:
    return DTYPE_BYTES[cfg.train.params_dtype]


def local_seq_length(cfg: RunConfig) -> int:
    """Tokens of one sequence on one CP rank: s / C (validate: s divisible by 2C, Megatron's load-balancing rule)."""
    return cfg.model.seq_length // cfg.parallel.context_parallel_size


def _sp_div(cfg: RunConfig) -> int:
    """Divisor of the [s, b, h] tensors outside the TP-split regions: t under sequence parallelism, else 1."""
    return cfg.parallel.tensor_model_parallel_size if cfg.parallel.sequence_parallel else 1


def layer_saved_tensors(cfg: RunConfig) -> dict[str, int]:
    """Bytes each saved tensor of one layer takes on one TP rank (of one CP rank: s / C tokens) for one micro-batch,
    for a layer outside any full recompute group (under selective recompute, without what the core-attention
    checkpoint frees)."""
    m, t = cfg.model, cfg.parallel.tensor_model_parallel_size
    s, b, h, f = local_seq_length(cfg), cfg.train.micro_batch_size, m.hidden_size, m.ffn_hidden_size
    q, kv = m.num_attention_heads * m.head_dim, m.kv_channels
    a, sp = activation_bytes(cfg), _sp_div(cfg)
    if m.is_moe:
        mlp = moe_saved_tensors(cfg)
    else:
        mlp = {"linear_fc1.input": a * s * b * h // sp,
               **({"swiglu.input=linear_fc1.output": a * s * b * 2 * f // t} if m.swiglu
                  else {"gelu.input=linear_fc1.output": a * s * b * f // t}),
               "linear_fc2.input": a * s * b * f // t}
    saved = {
        **_norm_saved(cfg, "input_layernorm"),
        "linear_qkv.input": a * s * b * h // sp,
        "attention.q": a * s * b * q // t,
        "attention.k": a * s * b * kv // t,
        "attention.v": a * s * b * kv // t,
        "attention.output=linear_proj.input": a * s * b * q // t,
        "attention.logsumexp": 4 * b * (m.num_attention_heads // t) * s,
        **_norm_saved(cfg, "pre_mlp_layernorm"),
        **mlp,
    }
    if cfg.recompute.recompute_granularity == "selective":
        saved = {name: n for name, n in saved.items() if name not in SELECTIVE_FREES}
    return saved


def moe_saved_tensors(cfg: RunConfig) -> dict[str, int]:
    """What an MoE layer's MLP part saves for one micro-batch on one rank (module docstring), with the rows its
    experts process taken under uniform routing; T = the rank's tokens (s/C x b, /t under SP). Grouped GEMMs
    (--moe-grouped-gemm) also keep the experts' stacked weights and the groups' int32 offsets, and at EP 1 carry
    every assignment's row (T k: the counts stay on the device), with a bool mask of the kept ones under a
    capacity factor."""
    m, t, ep = cfg.model, cfg.parallel.tensor_model_parallel_size, cfg.parallel.expert_model_parallel_size
    tokens = local_seq_length(cfg) * cfg.train.micro_batch_size // _sp_div(cfg)
    a, h, f, k = activation_bytes(cfg), m.hidden_size, m.expert_ffn_hidden_size, m.moe_router_topk
    rows = tokens * k if m.moe_grouped_gemm and ep == 1 else uniform_kept_assignments(tokens, m)
    aux = {"router.softmax_all_experts[fp32]": 4 * tokens * m.num_experts} if m.moe_aux_loss_coeff > 0 else {}
    local = m.num_experts // ep
    grouped = {"experts.stacked_weights": a * local * 3 * f // t * h, "experts.group_offsets[int32]": 4 * local,
               **({"experts.kept_rows[bool]": rows} if ep == 1 and m.moe_expert_capacity_factor is not None else {})
               } if m.moe_grouped_gemm else {}
    return {
        "router.input=pre_mlp_layernorm.output": a * tokens * h,
        "router.topk_indices[int64]": 8 * tokens * k,
        "router.probs[fp32]": 4 * tokens * k,
        **aux,
        "dispatch.row_index[int64]": 8 * rows,
        "experts.linear_fc1.input": a * rows * h,
        "experts.swiglu.input=linear_fc1.output": a * rows * 2 * f // t,
        "experts.linear_fc2.input": a * rows * f // t,
        **grouped,
        "combine.slot_index[int64]": 8 * tokens * k,
        "combine.expert_rows[fp32]": 4 * tokens * k * h,
    }


def _norm_saved(cfg: RunConfig, name: str) -> dict[str, int]:
    """A fused norm's saved input and fp32 rstd per token (and mean, for LayerNorm), sequence-sharded under SP."""
    m, sp = cfg.model, _sp_div(cfg)
    tokens = local_seq_length(cfg) * cfg.train.micro_batch_size
    stats = ("mean", "rstd") if m.layer_norm else ("rstd",)
    return {f"{name}.input": activation_bytes(cfg) * tokens * m.hidden_size // sp,
            **{f"{name}.{stat}": 4 * tokens // sp for stat in stats}}


def layer_bytes(cfg: RunConfig) -> int:
    """Saved bytes of one layer (outside any full recompute group) for one micro-batch while it waits for its
    backward."""
    return sum(layer_saved_tensors(cfg).values())


def layer_input_bytes(cfg: RunConfig) -> int:
    """A layer's input [s, b, h] ([s/t, b, h] under SP): all a full recompute group keeps."""
    m = cfg.model
    return activation_bytes(cfg) * local_seq_length(cfg) * cfg.train.micro_batch_size * m.hidden_size // _sp_div(cfg)


def layers_per_chunk(cfg: RunConfig) -> int:
    return cfg.model.num_layers // (cfg.parallel.pipeline_model_parallel_size * num_chunks(cfg))


def checkpoint_groups(cfg: RunConfig) -> list[tuple[int, bool]]:
    """A model chunk's layers as (layers, checkpointed) groups in forward order (Megatron's _checkpointed_forward):
    uniform N groups of N (the last shorter), block N the first N one by one and the rest plain; one plain group
    without full recompute. Every chunk of the run has the same layer count, so the same groups."""
    r, num_layers = cfg.recompute, layers_per_chunk(cfg)
    if r.recompute_granularity != "full":
        return [(num_layers, False)]
    n = r.recompute_num_layers
    if r.recompute_method == "uniform":
        return [(min(n, num_layers - start), True) for start in range(0, num_layers, n)]
    checkpointed = min(n, num_layers)
    return [(1, True)] * checkpointed + ([(num_layers - checkpointed, False)] if num_layers > checkpointed else [])


@dataclass(frozen=True)
class ChunkActivations:
    """One model chunk, one micro-batch: bytes held from its forward to its backward (saved), and the most held
    while its backward runs (backward_peak: a full recompute group's saved set rebuilt beside the earlier groups')."""
    saved: int
    backward_peak: int


def chunk_activation_bytes(cfg: RunConfig) -> ChunkActivations:
    layer, layer_input = layer_bytes(cfg), layer_input_bytes(cfg)
    held = peak = 0
    for layers, checkpointed in checkpoint_groups(cfg):
        if checkpointed:
            peak = max(peak, held + layers * layer)  # earlier groups still saved + this group rebuilt
        held += layer_input if checkpointed else layers * layer
    return ChunkActivations(saved=held, backward_peak=max(held, peak))


def first_stage_extra_bytes(cfg: RunConfig) -> int:
    """The embedding saves only its int64 token ids (its output is the first layer's saved input), and the position
    ids too with learned positions."""
    return 8 * local_seq_length(cfg) * cfg.train.micro_batch_size * (2 if cfg.model.learned_positions else 1)


def loss_chunk_tokens(cfg: RunConfig) -> int:
    """Tokens of one chunk of the fused output layer and loss (--cross-entropy-fusion-impl linear): the constant
    chunk, or the micro-batch's s/C b tokens when fewer."""
    return min(LINEAR_CROSS_ENTROPY_CHUNK_TOKENS, local_seq_length(cfg) * cfg.train.micro_batch_size)


def last_stage_extra_bytes(cfg: RunConfig) -> int:
    """Final norm input + rstd (+ mean), output layer input, and the loss: a bool target mask and int64 masked
    targets per token, and
    - unfused (Megatron's vocab-parallel cross-entropy): the fp32 softmax over the local vocab slice;
    - fused over chunks of tokens (linear): two fp32 figures per token (the max and the sum of exponentials), and one
      chunk's logits and their gradient, which the loss's backward holds at once while every activation is still
      saved (counted here, not as the logits transient)."""
    m, t = cfg.model, cfg.parallel.tensor_model_parallel_size
    s, b = local_seq_length(cfg), cfg.train.micro_batch_size
    a, sp = activation_bytes(cfg), _sp_div(cfg)
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, t)
    loss = (8 * s * b + 2 * a * loss_chunk_tokens(cfg) * vocab // t if m.linear_cross_entropy
            else 4 * s * b * vocab // t)
    return (sum(_norm_saved(cfg, "final_layernorm").values()) + a * s * b * m.hidden_size // sp
            + loss + s * b * (1 + 8))


def logits_transient_bytes(cfg: RunConfig) -> int:
    """The 16/32-bit logits (forward) or their gradient (backward) beside the saved fp32 softmax on the last stage:
    live only around the loss, so counted in the peak but not in the saved activations. None with the loss fused
    over chunks: the micro-batch's logits never exist (the chunk's are in last_stage_extra_bytes)."""
    m, t = cfg.model, cfg.parallel.tensor_model_parallel_size
    if m.linear_cross_entropy:
        return 0
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, t)
    return activation_bytes(cfg) * local_seq_length(cfg) * cfg.train.micro_batch_size * vocab // t


def in_flight(cfg: RunConfig, pp_rank: int) -> int:
    """Chunk-micro-batches whose activations stage `pp_rank` holds at its peak (see module docstring)."""
    p, v, m = cfg.parallel.pipeline_model_parallel_size, num_chunks(cfg), cfg.num_microbatches
    if p == 1:
        return 1
    if v == 1:
        return min(p - pp_rank, m)
    return min(2 * (p - pp_rank - 1) + (v - 1) * p + 1, m * v)


def stage_activation_bytes(cfg: RunConfig, pp_rank: int) -> int:
    """Peak saved activations on one TP rank of pipeline rank `pp_rank`: the larger of the moment a forward ends
    (every chunk-micro-batch in flight saved, the stage extras held) and the backward of the oldest one (the others
    saved, it at its backward peak; the last stage's loss tensors are freed before the decoder's backward starts)."""
    p = cfg.parallel.pipeline_model_parallel_size
    held, chunk = in_flight(cfg, pp_rank), chunk_activation_bytes(cfg)
    first = min(p, cfg.num_microbatches) * first_stage_extra_bytes(cfg) if pp_rank == 0 else 0
    last = last_stage_extra_bytes(cfg) if pp_rank == p - 1 else 0
    after_forward = held * chunk.saved + first + last
    in_backward = (held - 1) * chunk.saved + chunk.backward_peak + first
    return max(after_forward, in_backward)


def korthikanti_layer_bytes(s: int, b: int, h: int, heads: int, tp: int = 1, sequence_parallel: bool = False) -> float:
    """Korthikanti et al. 2022 (Table 2), 16-bit activations with dropout and unfused softmax attention:
    sbh(34 + 5as/h); TP: sbh(10 + 24/t + 5as/(ht)); TP + SP: sbh(34/t + 5as/(ht))."""
    quadratic = 5 * heads * s / (h * tp)
    if sequence_parallel:
        return s * b * h * (34 / tp + quadratic)
    return s * b * h * (10 + 24 / tp + quadratic)
