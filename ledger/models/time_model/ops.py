"""The work of one micro-batch through one model chunk on one rank, in execution order: the catalogue's kernels
(common/ops: names, dims and FLOPs at the rank's TP-local shapes, what the compute sweep times) laid out in passes,
with the collectives between them, for the time model to add up. Each pass is a list in execution order, so a
running sum of its times says when each parameter is first used in the forward (where its param all-gather is
waited for) and when its gradient is final in the backward (where its DP bucket can be issued).

TP collectives run on the compute stream (synchronous), so they are entries of the same lists, with Megatron's
placement: without SP an all-reduce after linear_proj and linear_fc2 forward and of linear_qkv's and linear_fc1's
input gradient backward; with SP an all-gather before linear_qkv / linear_fc1 and a reduce-scatter after
linear_proj / linear_fc2 forward, and backward their conjugates plus the re-gather of each saved input shard; the
embedding all-reduces (SP: reduce-scatters) its output, the output layer all-reduces its input gradient (SP: gathers
its input, and backward re-gathers and reduce-scatters), the vocab-parallel cross-entropy all-reduces three fp32
[s, b] tensors (fused with the output layer over chunks of tokens too: the chunks' figures are combined once). Per
step these are ledger/models/formulas/comm.py's counts, which a test holds these lists against.

The GPT style (ModelConfig; formulas only, the engine runs the Llama style): under SP the embedding all-reduces its
output (then splits it) instead of reduce-scattering it (learned positions are added to the whole sequence). Not
priced apart: the position table's lookup and add (first stage, one [s, b, h] add), the row-parallel bias adds
(fused into bias_dropout_add with the residual add) and bias gradients (a reduction over tokens beside the wgrad).

Context parallelism (C > 1; ledger/models/formulas/comm.py has the derivation of the ring's messages,
ledger/models/formulas/ring_overlap.py the blocks and the overlap): core attention is the engine's ring
(engine/transformer/ring_attention.py, Transformer Engine's AttnFuncWithCPAndKVP2P): C steps, each one block kernel
on the local queries (common/ops/attention.py), the causal diagonal (forward step 0, backward step C - 1) or an
unmasked half block. Beside the steps the ring's P2P messages run on their own stream (a `cp` Collective with
`overlaps`: the block computed meanwhile); only the part of a transfer longer than that block's compute is exposed
on the pass, ring_overlap.exchange_exposed: max(0, transfer - block). Forward: a message beside each of the first
C - 1 blocks; backward: one beside each block. A re-run forward (recompute) repeats the forward's ring. The merge
kernel of a pass comes after the blocks: the engine runs each merge before the wait, so it also hides its exchange,
which is not counted (an exchange longer than its block is priced up to one merge too exposed).

Mixture of experts (the model has experts: every layer's MLP is Megatron's MoELayer, engine/transformer/moe): after
the pre-MLP norm the router's GEMM, its top-k, permute, under EP > 1 the counts' and the rows' all-to-alls (`ep`
collectives on the compute stream: the experts need the rows), then each local expert's MLP at its own row count,
the combine all-to-all, and unpermute. Row counts come from the config under uniform routing (common/ops/shapes.py
ExpertShapes). Backward runs each in reverse: unpermute, the combine's all-to-all the other way, the experts' dgrad /
wgrad at their rows, the dispatch's, permute's, top-k's and the router's dgrad / wgrad. Under --moe-grouped-gemm
the experts' MLPs are the catalogue's grouped MLP (common/ops/mlp.py grouped_expert_ops): one grouped GEMM per
linear and pass over all the rows, with one SwiGLU over them (at EP 1 every assignment's row: the counts stay on the
device, so dropped rows are carried, zeroed); each fprop includes stacking the experts' weights. Every local
expert's weight of a linear is first used and final at its grouped GEMM. The permute and unpermute copies stay
priced at the kept rows (the same as T k without a capacity factor).

The loss fused with the output layer over chunks of tokens (--cross-entropy-fusion-impl linear,
engine/fusions/fused_linear_cross_entropy.py) runs the same kernels forward; backward first recomputes the logits
(the output layer's fprop once more, the chunks' GEMMs summing to the micro-batch's), its input re-gathered before
under SP and its input gradient reduce-scattered (or all-reduced) after the chunks.

Recompute (the run's mode, ledger/models/formulas/activations.py checkpoint_groups): full re-runs each checkpointed
group's forward at the start of its backward, up to its last saved tensor (torch's checkpoint early stop: the last
layer's fc2 output collective and residual add are not repeated); selective re-runs core_attention.fwd before its
backward.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.config import RunConfig
from common.ops import Kernel, Linear, Shapes, layer_ops, rank_ops
from common.ops.linear import GroupedLinear
from common.ops.rank import embedding, head, hook_add
from common.ops.sizes import DTYPE_BYTES
from ledger.models.formulas.activations import checkpoint_groups
from ledger.models.formulas.comm import ring_messages
from ledger.models.formulas.moe import COUNT_BYTES
from ledger.models.formulas.params import chunk_layers, chunk_tensors, num_chunks
from ledger.models.formulas.ring_overlap import ring_blocks

EMBEDDING, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"
POSITIONS = "embedding.position_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
# The op of a layer's forward after which a recompute's re-run has every saved tensor back: dense, MoE.
LAST_SAVED = ("linear_fc2.fprop", "moe.unpermute.fwd")
# Breakdown labels of a pass.
LAYERS, RECOMPUTE, TP_COMM, CP_COMM, EP_COMM = "layers", "recompute", "tp_comm", "cp_comm", "ep_comm"


@dataclass(frozen=True)
class Collective:
    group: str  # "tp", "cp", "ep"
    kind: str  # all_reduce | all_gather | reduce_scatter | send_recv | all_to_all
    size_bytes: int  # nccl-tests size: the all-reduce buffer, the gathered output, the reduce-scatter input
    overlaps: Kernel | None = None  # on its own stream beside this kernel: only the excess is exposed


@dataclass(frozen=True)
class Work:
    """One entry of a pass. `param`: in a forward, the parameter first used by this op; in a backward, the one whose
    gradient is final once this op ends; `with_param`: the parameters that go with it (a linear's or a norm's bias,
    the position table beside the word embedding). `term`: the breakdown label it is counted under."""
    op: Kernel | Collective
    term: str
    param: str | None = None
    with_param: tuple[str, ...] = ()

    @property
    def params(self) -> tuple[str, ...]:
        return ((self.param,) if self.param is not None else ()) + self.with_param


def core_attention(sh: Shapes, pass_: str, term: str = LAYERS) -> list[Work]:
    """One flash-attention kernel, or under CP the ring's C blocks each beside its message, then its merge (module
    docstring); Megatron-LM's unfused DotProductAttention: its batched GEMMs and masked softmax, K and V repeated
    first under GQA."""
    attention = layer_ops(sh).attention
    if attention.unfused is not None:
        return unfused_attention(sh, pass_, term)
    if attention.ring is None:
        return [Work(attention.core.of(pass_), term)]
    forward = pass_ == "fwd"
    messages = ring_messages(sh.cp, forward)
    work = []
    for step, causal in enumerate(ring_blocks(sh.cp, forward)):
        block = attention.ring.block(causal).of(pass_)
        if step < len(messages):
            work.append(Work(Collective("cp", "send_recv", messages[step] * sh.kv_block_bytes, overlaps=block),
                             CP_COMM))
        work.append(Work(block, term))
    return work + [Work(attention.ring.merge.of(pass_), term)]


def unfused_attention(sh: Shapes, pass_: str, term: str) -> list[Work]:
    a = layer_ops(sh).attention
    u, repeat = a.unfused, [Work(a.repeat_kv.of(pass_), term)] if a.repeat_kv is not None else []
    if pass_ == "fwd":
        return [*repeat, Work(u.scores, term), Work(u.softmax.fwd, term), Work(u.context, term)]
    return [Work(u.context_grad, term), Work(u.value_grad, term), Work(u.softmax.bwd, term),
            Work(u.scores_grad, term), Work(u.scores_grad, term), *repeat]


def _tp(sh: Shapes, kind: str) -> list[Work]:
    return [Work(Collective("tp", kind, sh.activation_bytes), TP_COMM)] if sh.tp > 1 else []


def _in_gather(sh: Shapes) -> list[Work]:
    """The gather of a column-parallel linear's sequence-sharded input (SP only)."""
    return _tp(sh, "all_gather") if sh.sequence_parallel else []


def _out_reduce(sh: Shapes) -> list[Work]:
    """A row-parallel linear's partial sums: reduce-scatter under SP, all-reduce otherwise."""
    return _tp(sh, "reduce_scatter" if sh.sequence_parallel else "all_reduce")


def _rope(sh: Shapes, pass_: str) -> list[Work]:
    rope = layer_ops(sh).attention.rope
    return [Work(rope.of(pass_), LAYERS)] if rope is not None else []


def layer_forward(sh: Shapes, prefix: str) -> list[Work]:
    k = layer_ops(sh)
    a = k.attention
    return [Work(k.norm.fwd, LAYERS, prefix + "input_layernorm.weight"), *_in_gather(sh),
            Work(a.qkv.fprop, LAYERS, prefix + "self_attention.linear_qkv.weight"),
            *_rope(sh, "fwd"), *core_attention(sh, "fwd"), Work(a.output_copy, LAYERS),
            Work(a.proj.fprop, LAYERS, prefix + "self_attention.linear_proj.weight"), *_out_reduce(sh),
            Work(k.residual_add, LAYERS), Work(k.norm.fwd, LAYERS, prefix + "pre_mlp_layernorm.weight"),
            *(moe_forward(sh, prefix) if sh.moe else mlp_forward(sh, prefix)), Work(k.residual_add, LAYERS)]


def mlp_forward(sh: Shapes, prefix: str) -> list[Work]:
    mlp = layer_ops(sh).mlp
    return [*_in_gather(sh), Work(mlp.fc1.fprop, LAYERS, prefix + "mlp.linear_fc1.weight"),
            Work(mlp.activation.fwd, LAYERS), Work(mlp.fc2.fprop, LAYERS, prefix + "mlp.linear_fc2.weight"),
            *_out_reduce(sh)]


def _ep(sh: Shapes, counts: bool = False) -> list[Work]:
    """An all-to-all over EP on the compute stream: the routed rows (nccl-tests size: the input buffer, R rows of h
    under uniform routing either way), or the per-expert counts before a dispatch (E int64)."""
    x = sh.moe
    if x.ep == 1:
        return []
    size = x.experts * COUNT_BYTES if counts else DTYPE_BYTES[sh.dtype] * x.routed * sh.hidden
    return [Work(Collective("ep", "all_to_all", size), EP_COMM)]


def _experts(sh: Shapes, prefix: str) -> list[tuple[int, str]]:
    """(rows, parameter prefix) of each local expert that gets rows (EP rank 0's global names: every EP rank
    registers the same shapes)."""
    return [(rows, f"{prefix}mlp.experts.{i}.") for i, rows in enumerate(sh.moe.rows) if rows > 0]


def _expert_params(sh: Shapes, prefix: str, linear: str) -> tuple[str, ...]:
    """Every local expert's weight of one linear (EP rank 0's global names): a grouped GEMM uses them all, and
    leaves all their gradients final, together."""
    return tuple(f"{prefix}mlp.experts.{i}.{linear}.weight" for i in range(sh.moe.local_experts))


def _grouped_forward(sh: Shapes, prefix: str) -> list[Work]:
    """fc1, SwiGLU over all the rows, fc2 (each fprop stacks the experts' weights first, timed with it)."""
    grouped = layer_ops(sh).moe.grouped
    fc1, fc2 = (_expert_params(sh, prefix, linear) for linear in ("linear_fc1", "linear_fc2"))
    return [Work(grouped.fc1.fprop, LAYERS, fc1[0], fc1[1:]), Work(grouped.activation.fwd, LAYERS),
            Work(grouped.fc2.fprop, LAYERS, fc2[0], fc2[1:])]


def _grouped_backward(sh: Shapes, prefix: str) -> list[Work]:
    """Each linear's grouped dgrad, then each expert's wgrad in expert order (none under --moe-delay-expert-wgrad:
    delayed_expert_wgrad)."""
    grouped = layer_ops(sh).moe.grouped

    def wgrads(linear: GroupedLinear, name: str) -> list[Work]:
        if sh.moe.delayed_wgrad_microbatches:
            return []
        return [w for rows, e in _experts(sh, prefix) for w in _wgrad(sh, linear.wgrad(rows), e + name)]

    return [Work(grouped.fc2.dgrad, LAYERS), *wgrads(grouped.fc2, "linear_fc2.weight"),
            Work(grouped.activation.bwd, LAYERS), Work(grouped.fc1.dgrad, LAYERS),
            *wgrads(grouped.fc1, "linear_fc1.weight")]


def moe_forward(sh: Shapes, prefix: str) -> list[Work]:
    """Router, permute, dispatch, each local expert's SwiGLU MLP at its rows (or the grouped GEMMs over all of
    them), combine, unpermute (module docstring)."""
    moe = layer_ops(sh).moe
    work = [Work(moe.router.fprop, LAYERS, prefix + "mlp.router.weight"), Work(moe.topk.fwd, LAYERS),
            Work(moe.permute.fwd, LAYERS), *_ep(sh, counts=True), *_ep(sh)]
    if moe.grouped is not None:
        work += _grouped_forward(sh, prefix)
    else:
        for rows, e in _experts(sh, prefix):
            expert = moe.expert(rows)
            work += [Work(expert.fc1.fprop, LAYERS, e + "linear_fc1.weight"), Work(expert.activation.fwd, LAYERS),
                     Work(expert.fc2.fprop, LAYERS, e + "linear_fc2.weight")]
    return work + [*_ep(sh), Work(moe.unpermute.fwd, LAYERS)]


def moe_backward(sh: Shapes, prefix: str) -> list[Work]:
    """The MoE layer's forward in reverse: each all-to-all's backward is one of the same size the other way."""
    moe = layer_ops(sh).moe
    work = [Work(moe.unpermute.bwd, LAYERS), *_ep(sh)]
    if moe.grouped is not None:
        work += _grouped_backward(sh, prefix)
    else:
        for rows, e in reversed(_experts(sh, prefix)):
            expert = moe.expert(rows)
            work += [*_expert_linear_backward(sh, expert.fc2, e + "linear_fc2.weight"),
                     Work(expert.activation.bwd, LAYERS),
                     *_expert_linear_backward(sh, expert.fc1, e + "linear_fc1.weight")]
    return work + [*_ep(sh), Work(moe.permute.bwd, LAYERS), Work(moe.topk.bwd, LAYERS),
                   *_linear_backward(sh, moe.router, prefix + "mlp.router.weight", False)]


def _expert_linear_backward(sh: Shapes, linear: Linear, param: str) -> list[Work]:
    """An expert linear's backward: its dgrad alone under --moe-delay-expert-wgrad (the wgrad waits for the step's
    end: delayed_expert_wgrad)."""
    if sh.moe.delayed_wgrad_microbatches:
        return [Work(linear.dgrad, LAYERS)]
    return _linear_backward(sh, linear, param, False)


def delayed_expert_wgrad(cfg: RunConfig, pp_rank: int) -> list[Work]:
    """Under --moe-delay-expert-wgrad, what finalize_model_grads runs before the gradients are reduced: each local
    expert's fc2 and fc1 wgrad of every MoE layer of the stage, over all the step's micro-batches (none otherwise)."""
    sh = Shapes.of(cfg)
    if sh.moe is None or not sh.moe.delayed_wgrad_microbatches:
        return []
    moe = layer_ops(sh).moe
    work = []
    for chunk in range(num_chunks(cfg)):
        for layer in chunk_layers(cfg, pp_rank, chunk):
            for rows, e in _experts(sh, f"decoder.layers.{layer}."):
                flush = moe.delayed(rows)
                work += [Work(flush.fc2_operands, LAYERS), Work(flush.fc2, LAYERS, e + "linear_fc2.weight"),
                         Work(flush.fc1_operands, LAYERS), Work(flush.fc1, LAYERS, e + "linear_fc1.weight")]
    return work


def _wgrad(sh: Shapes, wgrad: Kernel, param: str | None, term: str = LAYERS) -> list[Work]:
    """A weight's wgrad, then (no gradient-accumulation fusion) DDP's hook adding it into main_grad: the last entry
    leaves the weight's gradient final."""
    add = hook_add(sh, wgrad)
    return [Work(wgrad, term, param)] if add is None else [Work(wgrad, term), Work(add, term, param)]


def _linear_backward(sh: Shapes, linear: Linear, param: str | None, column: bool, term: str = LAYERS) -> list[Work]:
    """dgrad then wgrad in one autograd Function; a column-parallel linear under SP re-gathers its saved input first
    and reduce-scatters its input gradient before the wgrad; without SP its input gradient is all-reduced after.
    Without gradient-accumulation fusion (--no-gradient-accumulation-fusion) DDP's hook adds the 16-bit wgrad into
    main_grad."""
    dgrad = Work(linear.dgrad, term)
    wgrad = _wgrad(sh, linear.wgrad, param, term)
    if not column:
        return [dgrad, *wgrad]
    if sh.sequence_parallel:
        return [*_tp(sh, "all_gather"), dgrad, *_tp(sh, "reduce_scatter"), *wgrad]
    return [dgrad, *wgrad, *_tp(sh, "all_reduce")]


def layer_backward(sh: Shapes, prefix: str, selective: bool) -> list[Work]:
    k = layer_ops(sh)
    a = k.attention
    conj = _in_gather(sh)  # the conjugate of a forward reduce-scatter (identity for a forward all-reduce)
    rerun = core_attention(sh, "fwd", RECOMPUTE) if selective else []
    mlp = moe_backward(sh, prefix) if sh.moe else [
        *conj, *_linear_backward(sh, k.mlp.fc2, prefix + "mlp.linear_fc2.weight", False),
        Work(k.mlp.activation.bwd, LAYERS), *_linear_backward(sh, k.mlp.fc1, prefix + "mlp.linear_fc1.weight", True)]
    return [*mlp, Work(k.norm.bwd, LAYERS, prefix + "pre_mlp_layernorm.weight"), Work(k.residual_add, LAYERS),
            *conj, *_linear_backward(sh, a.proj, prefix + "self_attention.linear_proj.weight", False), *rerun,
            *core_attention(sh, "bwd"), *_rope(sh, "bwd"),
            *_linear_backward(sh, a.qkv, prefix + "self_attention.linear_qkv.weight", True),
            Work(k.norm.bwd, LAYERS, prefix + "input_layernorm.weight"), Work(k.residual_add, LAYERS)]


def recomputed(sh: Shapes, layers: list[int]) -> list[Work]:
    """A checkpointed group's forward as its backward re-runs it: up to the last saved tensor (linear_fc2's input
    and weight, saved once its GEMM has run; an MoE layer's combine rows, saved by unpermute), so the last layer's
    output collective and residual add are not repeated."""
    work = [w for layer in layers for w in layer_forward(sh, f"decoder.layers.{layer}.")]
    cut = max(i for i, w in enumerate(work) if isinstance(w.op, Kernel) and w.op.name in LAST_SAVED)
    return [Work(w.op, w.term if isinstance(w.op, Collective) else RECOMPUTE) for w in work[:cut + 1]]


def embedding_forward(sh: Shapes) -> list[Work]:
    """Under SP the lookup's partial sums are reduce-scattered; with learned positions (added to the whole
    sequence) all-reduced, then split."""
    reduce = _tp(sh, "all_reduce") if sh.sequence_parallel and not sh.rope else _out_reduce(sh)
    return [Work(embedding(sh).fwd, "embedding", EMBEDDING), *reduce]


def embedding_backward(sh: Shapes) -> list[Work]:
    return [*_in_gather(sh), Work(embedding(sh).bwd, "embedding", EMBEDDING)]


def head_forward(sh: Shapes, weight: str | None) -> list[Work]:
    """Final norm, output layer (its input gathered under SP inside the linear) and the vocab-parallel loss."""
    ops, norm = head(sh), layer_ops(sh).norm
    ce = [Work(Collective("tp", "all_reduce", 4 * sh.tokens), TP_COMM)] * 3 if sh.tp > 1 else []
    return [Work(norm.fwd, "final_norm", FINAL_NORM), *_in_gather(sh),
            Work(ops.output_layer.fprop, "output_layer", weight), Work(ops.cross_entropy.fwd, "cross_entropy"), *ce]


def head_backward(sh: Shapes, weight: str | None) -> list[Work]:
    """The loss's and the output layer's backward; with the loss fused over chunks of tokens the logits are first
    recomputed (the output layer's fprop once more: the engine interleaves it chunk by chunk with the rest, which
    sums to the whole micro-batch's kernels), the input re-gathered before it under SP and its gradient
    reduce-scattered (or all-reduced) after the chunks."""
    ops, norm = head(sh), layer_ops(sh).norm
    loss, final_norm = Work(ops.cross_entropy.bwd, "cross_entropy"), Work(norm.bwd, "final_norm", FINAL_NORM)
    if not sh.linear_cross_entropy:
        return [loss, *_linear_backward(sh, ops.output_layer, weight, True, "output_layer"), final_norm]
    gemms = _linear_backward(sh, ops.output_layer, weight, False, "output_layer")
    gather, reduce = ((_tp(sh, "all_gather"), _tp(sh, "reduce_scatter")) if sh.sequence_parallel
                      else ([], _tp(sh, "all_reduce")))
    return [*gather, Work(ops.output_layer.fprop, "output_layer"), loss, *gemms, *reduce, final_norm]


def output_param(cfg: RunConfig, pp_rank: int, chunk: int) -> str | None:
    """The output layer's own weight where the chunk registers one; tied on one stage it multiplies by the
    embedding's, whose gradient is final only after the embedding's backward."""
    return OUTPUT if any(t.name == OUTPUT for t in chunk_tensors(cfg, pp_rank, chunk)) else None


def chunk_ends(cfg: RunConfig, pp_rank: int, chunk: int) -> tuple[bool, bool]:
    """(holds the embedding, holds the output layer): chunk 0 of the first stage, last chunk of the last."""
    return (pp_rank == 0 and chunk == 0,
            pp_rank == cfg.parallel.pipeline_model_parallel_size - 1 and chunk == num_chunks(cfg) - 1)


def _with_companions(cfg: RunConfig, pp_rank: int, chunk: int, work: list[Work]) -> list[Work]:
    """Each weight's companions that the chunk registers (its bias; the word embedding's position table), used and
    final where the weight is."""
    names = {t.name for t in chunk_tensors(cfg, pp_rank, chunk)}

    def companions(param: str) -> tuple[str, ...]:
        candidates = (POSITIONS,) if param == EMBEDDING else (param.removesuffix("weight") + "bias",)
        return tuple(n for n in candidates if n in names)

    return [dataclasses.replace(w, with_param=found) if w.param is not None and (found := companions(w.param)) else w
            for w in work]


@dataclass(frozen=True)
class Block:
    """A run of a pass's entries: one transformer layer's (`layer`, its global number), or the rest's (None: the
    embedding's, the head's, a checkpointed group's re-run forward). A graphed layer (--cuda-graph-impl local) is
    one block on the host."""
    layer: int | None
    work: list[Work]


def chunk_blocks(cfg: RunConfig, pp_rank: int, chunk: int, forward: bool) -> list[Block]:
    """A chunk's forward or backward, block by block in the order it runs."""
    sh = Shapes.of(cfg)
    first, last = chunk_ends(cfg, pp_rank, chunk)
    layers = list(chunk_layers(cfg, pp_rank, chunk))
    if forward:
        blocks = [Block(None, embedding_forward(sh))] if first else []
        blocks += [Block(layer, layer_forward(sh, f"decoder.layers.{layer}.")) for layer in layers]
        blocks += [Block(None, head_forward(sh, output_param(cfg, pp_rank, chunk)))] if last else []
    else:
        selective = cfg.recompute.recompute_granularity == "selective"
        blocks = [Block(None, head_backward(sh, output_param(cfg, pp_rank, chunk)))] if last else []
        groups, start = [], 0
        for count, checkpointed in checkpoint_groups(cfg, pp_rank, chunk):
            groups.append((layers[start:start + count], checkpointed))
            start += count
        for group, checkpointed in reversed(groups):
            blocks += [Block(None, recomputed(sh, group))] if checkpointed else []
            blocks += [Block(layer, layer_backward(sh, f"decoder.layers.{layer}.", selective))
                       for layer in reversed(group)]
        blocks += [Block(None, embedding_backward(sh))] if first else []
    return [Block(b.layer, _with_companions(cfg, pp_rank, chunk, b.work)) for b in blocks if b.work]


def chunk_forward(cfg: RunConfig, pp_rank: int, chunk: int) -> list[Work]:
    return [w for b in chunk_blocks(cfg, pp_rank, chunk, True) for w in b.work]


def chunk_backward(cfg: RunConfig, pp_rank: int, chunk: int) -> list[Work]:
    return [w for b in chunk_blocks(cfg, pp_rank, chunk, False) for w in b.work]


def kernels(cfg: RunConfig, pp_rank: int) -> set[Kernel]:
    """Every distinct kernel a pipeline rank runs in a step: the catalogue's for its stage (all its chunks, both
    passes; recompute re-runs kernels already among them; without gradient-accumulation fusion each weight's
    main_grad add)."""
    last = cfg.parallel.pipeline_model_parallel_size - 1
    return set(rank_ops(Shapes.of(cfg), pp_rank == 0, pp_rank == last).kernels())
