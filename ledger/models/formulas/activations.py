"""Activation memory: the tensors our layer saves for backward, per layer, per micro-batch, per stage, under the
run's activation-recompute mode.

The details: docs/formulas.md, "The saved set by layer style, parallelism and recompute".
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.config import LINEAR_CROSS_ENTROPY_CHUNK_TOKENS, RecomputeConfig, RunConfig
from common.config.pipeline_layers import virtual_stage_layers
from common.ops.shapes import ExpertShapes
from common.ops.sizes import local_seq_length, vocab_shard
from ledger.models import schedule
from ledger.models.formulas import core_attention, megatron_layer
from ledger.models.formulas.bytes_per_param import DTYPE_BYTES
from ledger.models.formulas.megatron_layer import norm_saved
from ledger.models.formulas.moe import uniform_kept_assignments
from ledger.models.formulas.params import num_chunks

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


def _sp_div(cfg: RunConfig) -> int:
    """Divisor of the [s, b, h] tensors outside the TP-split regions: t under sequence parallelism, else 1."""
    return cfg.parallel.tensor_model_parallel_size if cfg.parallel.sequence_parallel else 1


def layer_saved_tensors(cfg: RunConfig) -> dict[str, int]:
    """Bytes each saved tensor of one layer takes on one TP rank (of one CP rank: s / C tokens) for one micro-batch,
    for a layer outside any full recompute group (under selective recompute, without what the core-attention
    checkpoint frees). Megatron-LM's own dense layer keeps what megatron_layer.py lists; this engine's (and, for
    want of a model of Megatron's, an MoE layer of Megatron-LM's) what follows."""
    if cfg.implementation.megatron and not cfg.model.is_moe:
        return megatron_layer.saved_tensors(cfg)
    m, t = cfg.model, cfg.parallel.tensor_model_parallel_size
    s, b, h, f = local_seq_length(cfg), cfg.train.micro_batch_size, m.hidden_size, m.ffn_hidden_size
    q, kv = m.num_attention_heads * m.head_dim, m.kv_channels
    a, sp = activation_bytes(cfg), _sp_div(cfg)
    if m.is_moe:
        mlp = moe_saved_tensors(cfg)
    else:
        mlp = {**_linear_input(cfg, "linear_fc1", s * b * h // sp),
               **({"swiglu.input=linear_fc1.output": a * s * b * 2 * f // t} if m.swiglu
                  else {"gelu.input=linear_fc1.output": a * s * b * f // t}),
               **_linear_input(cfg, "linear_fc2", s * b * f // t)}
    proj_input = ({"attention.output": a * s * b * q // t, **_linear_input(cfg, "linear_proj", s * b * q // t)}
                  if cfg.implementation.fp8 else {"attention.output=linear_proj.input": a * s * b * q // t})
    saved = {
        **norm_saved(cfg, "input_layernorm"),
        **_linear_input(cfg, "linear_qkv", s * b * h // sp),
        "attention.q": a * s * b * q // t,
        "attention.k": a * s * b * kv // t,
        "attention.v": a * s * b * kv // t,
        **proj_input,
        "attention.logsumexp": 4 * b * (m.num_attention_heads // t) * s,
        **norm_saved(cfg, "pre_mlp_layernorm"),
        **mlp,
    }
    if cfg.recompute.recompute_granularity == "selective":
        saved = {name: n for name, n in saved.items() if name not in SELECTIVE_FREES}
    return saved


def _linear_input(cfg: RunConfig, linear: str, numel: int) -> dict[str, int]:
    """What a layer linear saves of its input: the input, or under --fp8-format its fp8 cast (one byte an element:
    the compiled float8 matmul keeps the cast it multiplied, not the 16-bit tensor, which then goes unless another
    op saves it too, as SDPA saves its output, linear_proj's input). Scales (a few fp32 scalars) left out."""
    if cfg.implementation.fp8:
        return {f"{linear}.input[fp8]": numel}
    return {f"{linear}.input": activation_bytes(cfg) * numel}


def moe_saved_tensors(cfg: RunConfig) -> dict[str, int]:
    """What an MoE layer's MLP part saves for one micro-batch on one rank (module docstring), with the rows its
    experts process taken under uniform routing; T = the rank's tokens (s/C x b, /t under SP). Grouped GEMMs
    (--moe-grouped-gemm) also keep the groups' int32 offsets (the experts' weights they read in place, a view of
    DDP's buffer: grouped_gemm_util.py), and at EP 1 carry every assignment's row (T k: the counts stay on the
    device), with a bool mask of the kept ones under a capacity factor. Under --moe-pad-expert-rows the experts'
    tensors hold each expert's padded rows."""
    m, t, ep = cfg.model, cfg.parallel.tensor_model_parallel_size, cfg.parallel.expert_model_parallel_size
    tokens = local_seq_length(cfg) * cfg.train.micro_batch_size // _sp_div(cfg)
    a, h, f, k = activation_bytes(cfg), m.hidden_size, m.expert_ffn_hidden_size, m.moe_router_topk
    rows = tokens * k if m.moe_grouped_gemm and ep == 1 else uniform_kept_assignments(tokens, m)
    expert_rows = rows if m.moe_grouped_gemm else sum(ExpertShapes.of(cfg).rows)
    aux = {"router.softmax_all_experts[fp32]": 4 * tokens * m.num_experts} if m.moe_aux_loss_coeff > 0 else {}
    local = m.num_experts // ep
    grouped = {"experts.group_offsets[int32]": 4 * local,
               **({"experts.kept_rows[bool]": rows} if ep == 1 and m.moe_expert_capacity_factor is not None else {})
               } if m.moe_grouped_gemm else {}
    return {
        "router.input=pre_mlp_layernorm.output": a * tokens * h,
        "router.topk_indices[int64]": 8 * tokens * k,
        "router.probs[fp32]": 4 * tokens * k,
        **aux,
        "dispatch.row_index[int64]": 8 * rows,
        "experts.linear_fc1.input": a * expert_rows * h,
        "experts.swiglu.input=linear_fc1.output": a * expert_rows * 2 * f // t,
        "experts.linear_fc2.input": a * expert_rows * f // t,
        **grouped,
        "combine.slot_index[int64]": 8 * tokens * k,
        "combine.expert_rows=experts.output": a * (rows + 1) * h,
    }


def delayed_wgrad_bytes(cfg: RunConfig) -> int:
    """Under --moe-delay-expert-wgrad, what one MoE layer's backward of one micro-batch leaves held until the step's
    end on one rank: each expert linear's input and output gradient at the experts' rows (fc1 [rows, h] and
    [rows, 2f/t], fc2 [rows, f/t] and [rows, h]; grouped, each expert's are slices of the whole [N, .] tensors,
    which they keep); 0 otherwise."""
    x = ExpertShapes.of(cfg)
    if x is None or not x.delayed_wgrad_microbatches:
        return 0
    rows = x.grouped_rows if x.grouped else sum(x.rows)
    return activation_bytes(cfg) * rows * (2 * cfg.model.hidden_size + x.fc1 + x.ffn)


def delayed_wgrad_flush_bytes(cfg: RunConfig) -> int:
    """The largest concatenation beside the held operands as they are flushed: one fc1 weight's, its rows over every
    micro-batch ([M, 2f/t] and [M, h]); 0 without --moe-delay-expert-wgrad."""
    x = ExpertShapes.of(cfg)
    if x is None or not x.delayed_wgrad_rows:
        return 0
    return activation_bytes(cfg) * max(x.delayed_wgrad_rows) * (x.fc1 + cfg.model.hidden_size)


def layer_bytes(cfg: RunConfig) -> int:
    """Saved bytes of one layer (outside any full recompute group) for one micro-batch while it waits for its
    backward."""
    return sum(layer_saved_tensors(cfg).values())


def layer_input_bytes(cfg: RunConfig) -> int:
    """A layer's input [s, b, h] ([s/t, b, h] under SP): all a full recompute group keeps."""
    m = cfg.model
    return activation_bytes(cfg) * local_seq_length(cfg) * cfg.train.micro_batch_size * m.hidden_size // _sp_div(cfg)


def layers_per_chunk(cfg: RunConfig, pp_rank: int, chunk: int) -> int:
    return stage_chunk_layers(cfg, pp_rank)[chunk]


def stage_chunk_layers(cfg: RunConfig, pp_rank: int) -> tuple[int, ...]:
    """Each chunk's layer count on stage pp_rank, chunk by chunk."""
    return virtual_stage_layers(cfg.parallel, cfg.model.num_layers)[pp_rank::cfg.parallel.pipeline_model_parallel_size]


def chunk_layers_text(cfg: RunConfig, pp_rank: int) -> str:
    """The stage's layers a chunk, for a row's explanation: "2 layer(s)", or "0-1 layer(s)" where chunks differ."""
    counts = sorted(set(stage_chunk_layers(cfg, pp_rank)))
    return f"{counts[0]}{'' if len(counts) == 1 else f'-{counts[-1]}'} layer(s)"


def checkpoint_groups(cfg: RunConfig, pp_rank: int, chunk: int) -> list[tuple[int, bool]]:
    """A model chunk's layers as (layers, checkpointed) groups in forward order (Megatron's _checkpointed_forward)."""
    return _groups(cfg.recompute, layers_per_chunk(cfg, pp_rank, chunk))


def _groups(r: RecomputeConfig, num_layers: int) -> list[tuple[int, bool]]:
    """Full recompute, uniform N: groups of N (the last shorter); block N: the first N one by one, the rest plain.
    Otherwise one plain group; none for no layers."""
    if r.recompute_granularity != "full":
        return [(num_layers, False)] if num_layers else []
    n = r.recompute_num_layers
    if r.recompute_method == "uniform":
        return [(min(n, num_layers - start), True) for start in range(0, num_layers, n)]
    checkpointed = min(n, num_layers)
    return [(1, True)] * checkpointed + ([(num_layers - checkpointed, False)] if num_layers > checkpointed else [])


def recomputed_groups(cfg: RunConfig, pp_rank: int) -> list[int]:
    """The layer count of each group a full recompute re-runs on the stage, per micro-batch, chunk by chunk."""
    return [g for c in range(num_chunks(cfg)) for g, checkpointed in checkpoint_groups(cfg, pp_rank, c) if checkpointed]


def recomputed_layer_count(cfg: RunConfig, pp_rank: int) -> int:
    """Layers whose forward a full recompute re-runs on the stage, per micro-batch."""
    return sum(recomputed_groups(cfg, pp_rank))


@dataclass(frozen=True)
class ChunkActivations:
    """One model chunk, one micro-batch: bytes held from its forward to its backward (saved), and the most held
    while its backward runs (backward_peak: a full recompute group's saved set rebuilt beside the earlier groups')."""
    saved: int
    backward_peak: int


def chunk_activation_bytes(cfg: RunConfig, pp_rank: int, chunk: int) -> ChunkActivations:
    return _chunk_activations(cfg, layers_per_chunk(cfg, pp_rank, chunk))


def _chunk_activations(cfg: RunConfig, num_layers: int) -> ChunkActivations:
    """A chunk of num_layers layers. Graphed layers (--cuda-graph-impl local) save into their graphs' pool, which the
    allocator counts as free (cuda_graphs.py): nothing here."""
    if cfg.implementation.graphed_layers:
        return ChunkActivations(saved=0, backward_peak=0)
    layer, layer_input = layer_bytes(cfg), layer_input_bytes(cfg)
    held = peak = 0
    for layers, checkpointed in _groups(cfg.recompute, num_layers):
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
    """Final norm input + rstd (+ mean), output layer input (and under --fp8-output-layer its input's and weight's fp8
    casts), and what the loss saves (loss_saved_bytes)."""
    m = cfg.model
    s, b = local_seq_length(cfg), cfg.train.micro_batch_size
    a, sp = activation_bytes(cfg), _sp_div(cfg)
    # --fp8-output-layer: the compiled matmul also keeps its input's and its weight's 1-byte casts (FP8)
    fp8_head = (s * b * m.hidden_size // sp + vocab_shard(cfg) * m.hidden_size
                if cfg.implementation.fp8_output_layer else 0)
    return (sum(norm_saved(cfg, "final_layernorm").values()) + a * s * b * m.hidden_size // sp + fp8_head
            + loss_saved_bytes(cfg))


def loss_saved_bytes(cfg: RunConfig) -> int:
    """The loss's saved tensors: a bool target mask and int64 masked targets per token, and
    - Megatron-LM's vocab-parallel cross-entropy: the fp32 softmax over the local vocab slice;
    - this engine's (engine/tensor_parallel/cross_entropy.py): the 16-bit logits and two fp32 figures per token (the
      max and the sum of exponentials), from which its backward recomputes the softmax;
    - fused over chunks of tokens (linear): the two fp32 figures, and one chunk's logits and their gradient, which
      the loss's backward holds at once while every activation is still saved (counted here, not as the logits
      transient)."""
    tokens, vocab = local_seq_length(cfg) * cfg.train.micro_batch_size, vocab_shard(cfg)
    if cfg.model.linear_cross_entropy:
        loss = 8 * tokens + loss_chunk_bytes(cfg)
    elif cfg.implementation.megatron:
        loss = 4 * tokens * vocab
    else:
        loss = 8 * tokens + activation_bytes(cfg) * tokens * vocab
    return loss + tokens * (1 + 8)


def loss_chunk_bytes(cfg: RunConfig) -> int:
    """One chunk's 16-bit logits and their gradient in the fused loss's backward (--cross-entropy-fusion-impl
    linear)."""
    return 2 * activation_bytes(cfg) * loss_chunk_tokens(cfg) * vocab_shard(cfg)


def output_input_grad_bytes(cfg: RunConfig) -> int:
    """The output layer's input gradient, [s, b, h] in 16-bit: whole-sequence under SP too (the dgrad GEMM's output,
    before its reduce-scatter)."""
    return activation_bytes(cfg) * local_seq_length(cfg) * cfg.train.micro_batch_size * cfg.model.hidden_size


def logits_transient_bytes(cfg: RunConfig) -> int:
    """The 16/32-bit logits (Megatron-LM: forward, beside the fp32 softmax it saves) or their gradient (this engine:
    backward, beside the logits it saved) on the last stage: live only around the loss, so counted in the peak's
    phases but not in the saved activations. None with the loss fused over chunks: the micro-batch's logits never
    exist (the chunk's are in loss_saved_bytes)."""
    if cfg.model.linear_cross_entropy:
        return 0
    return activation_bytes(cfg) * local_seq_length(cfg) * cfg.train.micro_batch_size * vocab_shard(cfg)


def output_weight_bytes(cfg: RunConfig) -> int:
    """The output layer's weight on one TP rank ([V/t, h], 16-bit): the placeholder gradient its backward returns
    once the wgrad GEMM added into main_grad (engine/tensor_parallel/layers.py) is one of its size."""
    return activation_bytes(cfg) * vocab_shard(cfg) * cfg.model.hidden_size


def in_flight(cfg: RunConfig, pp_rank: int) -> int:
    """Chunk-micro-batches whose activations stage `pp_rank` holds at its peak (see module docstring)."""
    p, v, m = cfg.parallel.pipeline_model_parallel_size, num_chunks(cfg), cfg.num_microbatches
    if p == 1:
        return 1
    if v == 1:
        return min(p - pp_rank, m)
    return min(2 * (p - pp_rank - 1) + (v - 1) * p + 1, m * v)


def first_stage_bytes(cfg: RunConfig, pp_rank: int) -> int:
    """The first stage's token ids of every micro-batch it holds (min(p, m) in flight under 1F1B)."""
    if pp_rank != 0:
        return 0
    return min(cfg.parallel.pipeline_model_parallel_size, cfg.num_microbatches) * first_stage_extra_bytes(cfg)


def mask_bytes_in_flight(cfg: RunConfig, pp_rank: int) -> int:
    """Megatron-LM's dataloader masks that its layers keep, one per micro-batch in flight (core_attention)."""
    return in_flight(cfg, pp_rank) * core_attention.mask_bytes(cfg) if core_attention.keeps_mask(cfg) else 0


@dataclass(frozen=True)
class HeldChunks:
    """The chunks' saved bytes a stage holds at its peak moments: when a forward ends (every chunk-micro-batch in
    flight saved), while a backward runs (the others saved, it at its backward peak), when a forward reaches its
    chunk's last layer (the others saved and its earlier layers') and when a backward starts in a chunk whose last
    layer is not recomputed (every chunk-micro-batch saved; None where no chunk has such a layer)."""
    forward_end: int
    in_backward: int
    at_last_layer: int
    backward_start: int | None


def held_chunks(cfg: RunConfig, pp_rank: int) -> HeldChunks:
    """With chunks alike, in_flight of them. Chunks of different layer counts (the embedding or the loss counted
    in the pipeline split): the most over the stage's schedule (ledger.models.schedule), walked item by item."""
    counts, layer = stage_chunk_layers(cfg, pp_rank), layer_bytes(cfg)
    plain_last = {n: _last_layer_plain(cfg, n) for n in set(counts)}
    if len(set(counts)) == 1:
        held, n = in_flight(cfg, pp_rank), counts[0]
        chunk = _chunk_activations(cfg, n)
        return HeldChunks(held * chunk.saved, (held - 1) * chunk.saved + chunk.backward_peak,
                          (held - 1) * chunk.saved + (n - 1) * layer if n else 0,
                          held * chunk.saved if plain_last[n] else None)
    by_count = {n: _chunk_activations(cfg, n) for n in set(counts)}
    p, m = cfg.parallel.pipeline_model_parallel_size, cfg.num_microbatches
    saved = forward_end = in_backward = at_last_layer = 0
    backward_start = None
    for item in schedule.stage_order(p, pp_rank, m, len(counts)):
        n = counts[item.chunk]
        chunk = by_count[n]
        if item.kind == schedule.FORWARD:
            if n:
                at_last_layer = max(at_last_layer, saved + (n - 1) * layer)
            saved += chunk.saved
            forward_end = max(forward_end, saved)
        else:
            if plain_last[n]:
                backward_start = max(backward_start or 0, saved)
            in_backward = max(in_backward, saved - chunk.saved + chunk.backward_peak)
            saved -= chunk.saved
    return HeldChunks(forward_end, in_backward, at_last_layer, backward_start)


def _last_layer_plain(cfg: RunConfig, num_layers: int) -> bool:
    """Whether a chunk of num_layers layers has a last layer its backward does not rebuild (full recompute's)."""
    groups = _groups(cfg.recompute, num_layers)
    return bool(groups) and not groups[-1][1]


def layers_backward_before_last_forward(cfg: RunConfig, pp_rank: int) -> int:
    """The stage's layers over every chunk-micro-batch whose backward ran before its last forward (walked over its
    schedule): under --moe-delay-expert-wgrad, the layers whose expert operands are held as the steady phase ends."""
    counts = stage_chunk_layers(cfg, pp_rank)
    done = before_last = 0
    for item in schedule.stage_order(cfg.parallel.pipeline_model_parallel_size, pp_rank, cfg.num_microbatches,
                                     len(counts)):
        if item.kind == schedule.FORWARD:
            before_last = done
        else:
            done += counts[item.chunk]
    return before_last


def end_of_forward_bytes(cfg: RunConfig, pp_rank: int) -> int:
    """Saved when a forward ends: every chunk-micro-batch in flight, the stage extras and the kept masks."""
    last = last_stage_extra_bytes(cfg) if pp_rank == cfg.parallel.pipeline_model_parallel_size - 1 else 0
    return (held_chunks(cfg, pp_rank).forward_end + first_stage_bytes(cfg, pp_rank) + last
            + mask_bytes_in_flight(cfg, pp_rank))


def stage_activation_bytes(cfg: RunConfig, pp_rank: int) -> int:
    """Peak saved activations on one TP rank of pipeline rank `pp_rank`: the larger of the moment a forward ends
    (every chunk-micro-batch in flight saved, the stage extras held) and a backward (the others saved, it at its
    backward peak; the last stage's loss tensors are freed before the decoder's backward starts)."""
    in_backward = (held_chunks(cfg, pp_rank).in_backward + first_stage_bytes(cfg, pp_rank)
                   + mask_bytes_in_flight(cfg, pp_rank))
    return max(end_of_forward_bytes(cfg, pp_rank), in_backward)
