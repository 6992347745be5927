"""The work of one micro-batch through one model chunk on one rank, op by op at TP-local shapes: what the compute
sweep (probes/compute_sweep.py) times and the time model adds up.

Kernels are named after the engine's modules and passes, with Megatron Core's names (linear_qkv.fprop / .dgrad /
.wgrad, core_attention.fwd / .bwd, ...), and carry the dims that set their cost, so a calibration record matches a
kernel by (name, dims, dtype). The probe derives its list independently from the run's config; a test holds the two
equal. Each pass is a list in execution order, so a running sum of its times says when each parameter is first used
in the forward (where its param all-gather is waited for) and when its gradient is final in the backward (where its
DP bucket can be issued).

TP collectives run on the compute stream (synchronous), so they are entries of the same lists, with Megatron's
placement: without SP an all-reduce after linear_proj and linear_fc2 forward and of linear_qkv's and linear_fc1's
input gradient backward; with SP an all-gather before linear_qkv / linear_fc1 and a reduce-scatter after linear_proj
/ linear_fc2 forward, and backward their conjugates plus the re-gather of each saved input shard; the embedding
all-reduces (SP: reduce-scatters) its output, the output layer all-reduces its input gradient (SP: gathers its
input, and backward re-gathers and reduce-scatters), the vocab-parallel cross-entropy all-reduces three fp32 [s, b]
tensors (fused with the output layer over chunks of tokens too: the chunks' figures are combined once). Per step
these are ledger/models/formulas/comm.py's counts, which a test holds these lists against.

The GPT style (ModelConfig; formulas only, the engine runs the Llama style): linear_fc1 is f wide and a
gelu.fwd / gelu.bwd kernel (Megatron's bias_gelu: the bias add fused in) replaces swiglu's; learned positions run no
rope kernels, and under SP the embedding all-reduces its output (then splits it) instead of reduce-scattering it.
Not priced apart: the position table's lookup and add (first stage, one [s, b, h] add), the row-parallel bias adds
(fused into bias_dropout_add with the residual add) and bias gradients (a reduction over tokens beside the wgrad).
LayerNorm runs layer_norm.fwd / .bwd where RMSNorm runs rms_norm's, at the same dims.

Context parallelism (C > 1; ledger/models/formulas/comm.py has the derivation of the ring's messages,
ledger/models/formulas/ring_overlap.py the blocks and the overlap): every op runs at the CP rank's L = s/C tokens,
and core attention becomes the engine's ring (engine/transformer/ring_attention.py, Transformer Engine's
AttnFuncWithCPAndKVP2P): C steps, each one block kernel on the local queries, keyed apart from the dense kernel by
`queries` and `causal` (seq: L, every block's keys). With Megatron's load balancing each step's block is either the
causal diagonal (the rank's own K/V, L x L: forward step 0, backward step C - 1) or an unmasked half block, priced
as L/2 queries against L keys (rank i's steps with a later rank's block; with an earlier rank's block it runs L
queries against L/2 keys, the same L^2/2 query-key pairs, timed as the former); both are 2 b h L^2 d FLOPs forward,
2.5x backward. Beside the steps the ring's P2P messages run on their own stream (a `cp` Collective with `overlaps`:
the block computed meanwhile); only the part of a transfer longer than that block's compute is exposed on the pass,
ring_overlap.exchange_exposed: max(0, transfer - block). Forward: a message beside each of the first C - 1 blocks;
backward: one beside each block. A re-run forward (recompute) repeats the forward's ring. The online-softmax merge
of each later block's output into the running one (forward) and the dQ / dK-dV accumulations (backward) are one
`ring_attention.merge` kernel a pass (the sweep times the engine's ring loop with its blocks precomputed), added
after the blocks: the engine runs each merge before the wait, so it also hides its exchange, which is not counted
(an exchange longer than its block is priced up to one merge too exposed).

Mixture of experts (the model has experts: every layer's MLP is Megatron's MoELayer, engine/transformer/moe): after
the pre-MLP norm the router's GEMM `router.fprop` [T, h] x [h, E] (T = the rank's routed tokens), `router.topk.fwd`
(top-k over the logits, the softmax over the k chosen and, with a load-balancing loss, over all E, the counts per
expert), `moe.permute.fwd` (the kept assignments sorted by expert and their rows gathered: R = kept assignments rows
of h), under EP > 1 the counts' and the rows' all-to-alls (`ep` collectives on the compute stream: the experts need
the rows), then each local expert's SwiGLU MLP at its own row count (linear_fc1 / swiglu / linear_fc2 at m = its
rows: the same kernels as a dense MLP's, keyed by their dims), the combine all-to-all, and `moe.unpermute.fwd` (each
token's probability-weighted sum over its k slots, in fp32). Row counts come from the config under uniform routing
(ledger/models/formulas/moe.py uniform_kept_assignments: T k assignments, capped by a capacity factor; every EP rank
routing alike, a rank's experts receive what it sends, split as evenly as the count allows over its E/EP experts).
Backward runs each in reverse: unpermute, the combine's all-to-all the other way, the experts' dgrad / wgrad at their
rows, the dispatch's, permute's (the rows' gradients added back per token), top-k's and the router's dgrad / wgrad.
Under --moe-grouped-gemm the experts' GEMMs are one grouped kernel per linear and pass (`experts.linear_fc1.fprop`,
..., keyed by the local expert count beside m, n, k) over all the rows, with one SwiGLU over them: at EP 1 every
assignment's row (T k: the counts stay on the device, so dropped rows are carried, zeroed), under EP > 1 the kept
ones received. Each fprop includes stacking the experts' weights (the engine's copy per forward). The permute and
unpermute copies stay priced at the kept rows (the same as T k without a capacity factor).

Recompute (the run's mode, ledger/models/formulas/activations.py checkpoint_groups): full re-runs each checkpointed
group's forward at the start of its backward, up to its last saved tensor (torch's checkpoint early stop: the last
layer's fc2 output collective and residual add are not repeated); selective re-runs core_attention.fwd before its
backward.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from common.config import RunConfig
from ledger.models.formulas.activations import checkpoint_groups, local_seq_length
from ledger.models.formulas.bytes_per_param import DTYPE_BYTES
from ledger.models.formulas.comm import ring_messages, routed_tokens
from ledger.models.formulas.moe import COUNT_BYTES, uniform_kept_assignments
from ledger.models.formulas.params import chunk_layers, chunk_tensors, fc1_width, num_chunks, padded_vocab_size
from ledger.models.formulas.ring_overlap import ring_blocks

EMBEDDING, OUTPUT = "embedding.word_embeddings.weight", "output_layer.weight"
POSITIONS = "embedding.position_embeddings.weight"
FINAL_NORM = "decoder.final_layernorm.weight"
# Ops whose cost is per element of a buffer, calibrated at one size and scaled (the sweep records their numel).
RATE_OPS = ("optimizer.step", "grad_buffer.zero")
# The sweep's record of a layer's kernels back to back at the device's power limit (calibration.py).
SUSTAINED = "sustained.layer"
# The op of a layer's forward after which a recompute's re-run has every saved tensor back: dense, MoE.
LAST_SAVED = ("linear_fc2.fprop", "moe.unpermute.fwd")
# Breakdown labels of a pass.
LAYERS, RECOMPUTE, TP_COMM, CP_COMM, EP_COMM = "layers", "recompute", "tp_comm", "cp_comm", "ep_comm"


@dataclass(frozen=True)
class Kernel:
    name: str
    dims: tuple[tuple[str, int], ...]  # sorted (dim, size)
    flops: float = 0.0

    def describe(self) -> str:
        return f"{self.name}[{', '.join(f'{k}={v}' for k, v in self.dims)}]"


def kernel(name: str, flops: float = 0.0, **dims: int) -> Kernel:
    return Kernel(name, tuple(sorted(dims.items())), flops)


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


@dataclass(frozen=True)
class Shapes:
    """One micro-batch's TP-local dims on one CP rank: seq = s / cp, tokens = seq b (GEMM rows, all-gathered under
    SP), norm_tokens = seq b / t under SP (norms, residual adds); widths local to the TP rank."""
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
    moe: "ExpertShapes | None" = None  # None for a dense MLP
    linear_cross_entropy: bool = False  # the loss fused with the output layer over chunks (recomputes the logits)

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
                   vocab=padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, t) // t, tp=t,
                   sequence_parallel=p.sequence_parallel, cp=p.context_parallel_size, moe=ExpertShapes.of(cfg),
                   linear_cross_entropy=m.linear_cross_entropy)

    @property
    def activation_bytes(self) -> int:
        """The full [s, b, h] activation: every TP collective's nccl-tests size."""
        return DTYPE_BYTES[self.dtype] * self.tokens * self.hidden

    @property
    def kv_block_bytes(self) -> int:
        """|KV|: this rank's K and V blocks, [s/C, b, n_kv/t, d] each (comm.kv_block_bytes)."""
        return 2 * DTYPE_BYTES[self.dtype] * self.tokens * self.kv_heads * self.head_dim


@dataclass(frozen=True)
class ExpertShapes:
    """One micro-batch's MoE layer on one rank under uniform routing: `tokens` routed (T), `routed` kept assignments
    (R: permuted rows, sent and, every rank alike, received), `rows` per local expert, widths local to the TP rank;
    the router's options that change its kernels."""
    experts: int  # E, global
    topk: int
    tokens: int
    routed: int
    rows: tuple[int, ...]
    ffn: int  # f_moe / t
    ep: int
    aux_loss: int  # 1 with a load-balancing loss (its softmax over all E), else 0
    dropping: int  # 1 with a capacity factor (the drop policy's sorts), else 0
    grouped: bool = False  # --moe-grouped-gemm: each expert linear one grouped GEMM over `grouped_rows`

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
                   rows=tuple(each + (i < extra) for i in range(m.num_experts // ep)),
                   ffn=m.expert_ffn_hidden_size // cfg.parallel.tensor_model_parallel_size, ep=ep,
                   aux_loss=int(m.moe_aux_loss_coeff > 0), dropping=int(m.moe_expert_capacity_factor is not None),
                   grouped=m.moe_grouped_gemm)

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


def _gemm(name: str, m: int, n: int, k: int) -> Kernel:
    return kernel(name, 2.0 * m * n * k, m=m, n=n, k=k)


def _attention(sh: Shapes, pass_: str) -> Kernel:
    """Causal flash attention: QK^T and PV are 4 b heads s^2 d FLOPs forward, halved by the mask; backward 2.5x."""
    forward = 2.0 * sh.micro_batch * sh.heads * sh.seq ** 2 * sh.head_dim
    return kernel(f"core_attention.{pass_}", forward * (2.5 if pass_ == "bwd" else 1.0), batch=sh.micro_batch,
                  heads=sh.heads, kv_heads=sh.kv_heads, seq=sh.seq, head_dim=sh.head_dim)


def ring_block(sh: Shapes, pass_: str, causal: bool) -> Kernel:
    """One ring step's block kernel on L = s/C local tokens: the causal diagonal (L x L) or an unmasked half block
    (L/2 queries x L keys); L^2/2 query-key pairs either way, 4 d FLOPs each forward, 2.5x backward."""
    length = sh.seq
    forward = 2.0 * sh.micro_batch * sh.heads * length ** 2 * sh.head_dim
    return kernel(f"core_attention.{pass_}", forward * (2.5 if pass_ == "bwd" else 1.0), batch=sh.micro_batch,
                  heads=sh.heads, kv_heads=sh.kv_heads, seq=length, queries=length if causal else length // 2,
                  causal=int(causal), head_dim=sh.head_dim)


def ring_merge(sh: Shapes, pass_: str) -> Kernel:
    """A ring pass's work beside its blocks: the forward's online-softmax merges, the backward's dQ / dK-dV
    accumulations (the sweep times the engine's ring loop with its blocks precomputed)."""
    return kernel(f"ring_attention.merge.{pass_}", batch=sh.micro_batch, heads=sh.heads, kv_heads=sh.kv_heads,
                  seq=sh.seq, head_dim=sh.head_dim, cp=sh.cp)


def core_attention(sh: Shapes, pass_: str, term: str = LAYERS) -> list[Work]:
    """One flash-attention kernel, or under CP the ring's C blocks each beside its message, then its merges (module
    docstring)."""
    if sh.cp == 1:
        return [Work(_attention(sh, pass_), term)]
    forward = pass_ == "fwd"
    messages = ring_messages(sh.cp, forward)
    work = []
    for step, causal in enumerate(ring_blocks(sh.cp, forward)):
        block = ring_block(sh, pass_, causal)
        if step < len(messages):
            work.append(Work(Collective("cp", "send_recv", messages[step] * sh.kv_block_bytes, overlaps=block),
                             CP_COMM))
        work.append(Work(block, term))
    return work + [Work(ring_merge(sh, pass_), term)]


def _norm(sh: Shapes, pass_: str) -> Kernel:
    return kernel(f"{sh.norm}.{pass_}", tokens=sh.norm_tokens, hidden=sh.hidden)


def _residual(sh: Shapes) -> Kernel:
    return kernel("residual_add", numel=sh.norm_tokens * sh.hidden)


def _rope(sh: Shapes, pass_: str) -> list[Work]:
    """split_qkv_and_rotate on the fused QKV viewed as [s, b, groups, heads per group + 2, d]; none with learned
    positions."""
    return [Work(kernel(f"rope.{pass_}", seq=sh.seq, batch=sh.micro_batch, groups=sh.kv_heads,
                        width=sh.heads // sh.kv_heads + 2, head_dim=sh.head_dim), LAYERS)] if sh.rope else []


def _activation(sh: Shapes, pass_: str) -> Work:
    """The MLP's activation on fc1's output: fused SwiGLU (gate and up: 2f wide) or bias-GeLU (f wide)."""
    return Work(kernel(f"{'swiglu' if sh.swiglu else 'gelu'}.{pass_}", tokens=sh.tokens, width=sh.fc1), LAYERS)


def _tp(sh: Shapes, kind: str) -> list[Work]:
    return [Work(Collective("tp", kind, sh.activation_bytes), TP_COMM)] if sh.tp > 1 else []


def _in_gather(sh: Shapes) -> list[Work]:
    """The gather of a column-parallel linear's sequence-sharded input (SP only)."""
    return _tp(sh, "all_gather") if sh.sequence_parallel else []


def _out_reduce(sh: Shapes) -> list[Work]:
    """A row-parallel linear's partial sums: reduce-scatter under SP, all-reduce otherwise."""
    return _tp(sh, "reduce_scatter" if sh.sequence_parallel else "all_reduce")


def _fprop(sh: Shapes, name: str, out: int, inp: int, param: str | None, term: str = LAYERS) -> Work:
    return Work(_gemm(f"{name}.fprop", sh.tokens, out, inp), term, param)


def layer_forward(sh: Shapes, prefix: str) -> list[Work]:
    t, h = sh.tokens, sh.hidden
    return [Work(_norm(sh, "fwd"), LAYERS, prefix + "input_layernorm.weight"), *_in_gather(sh),
            _fprop(sh, "linear_qkv", sh.qkv, h, prefix + "self_attention.linear_qkv.weight"),
            *_rope(sh, "fwd"), *core_attention(sh, "fwd"),
            Work(kernel("attention_output.copy", numel=t * sh.query), LAYERS),
            _fprop(sh, "linear_proj", h, sh.query, prefix + "self_attention.linear_proj.weight"), *_out_reduce(sh),
            Work(_residual(sh), LAYERS),
            Work(_norm(sh, "fwd"), LAYERS, prefix + "pre_mlp_layernorm.weight"),
            *(moe_forward(sh, prefix) if sh.moe else mlp_forward(sh, prefix)), Work(_residual(sh), LAYERS)]


def mlp_forward(sh: Shapes, prefix: str) -> list[Work]:
    h = sh.hidden
    return [*_in_gather(sh), _fprop(sh, "linear_fc1", sh.fc1, h, prefix + "mlp.linear_fc1.weight"),
            _activation(sh, "fwd"), _fprop(sh, "linear_fc2", h, sh.ffn, prefix + "mlp.linear_fc2.weight"),
            *_out_reduce(sh)]


def _router_topk(x: ExpertShapes, pass_: str) -> Kernel:
    return kernel(f"router.topk.{pass_}", tokens=x.tokens, experts=x.experts, topk=x.topk, aux_loss=x.aux_loss,
                  dropping=x.dropping)


def _moe_copy(sh: Shapes, name: str) -> Kernel:
    """moe.permute / moe.unpermute: memory-bound copies of the rank's R routed rows of h (and the T k slots)."""
    x = sh.moe
    return kernel(name, tokens=x.tokens, topk=x.topk, rows=x.routed, hidden=sh.hidden)


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


def grouped_gemm(name: str, x: ExpertShapes, m: int, n: int, k: int) -> Kernel:
    """One grouped GEMM over the rank's experts (--moe-grouped-gemm): `m` x `n` outputs from `k` inputs in all,
    split over the experts' groups of rows; keyed apart from a dense GEMM by `experts`."""
    return kernel(name, 2.0 * m * n * k, experts=x.local_experts, m=m, n=n, k=k)


def _grouped_forward(sh: Shapes, prefix: str) -> list[Work]:
    """fc1, SwiGLU over all the rows, fc2; each fprop stacks the experts' weights first (timed with it)."""
    x, h, rows = sh.moe, sh.hidden, sh.moe.grouped_rows
    fc1, fc2 = (_expert_params(sh, prefix, linear) for linear in ("linear_fc1", "linear_fc2"))
    return [Work(grouped_gemm("experts.linear_fc1.fprop", x, rows, x.fc1, h), LAYERS, fc1[0], fc1[1:]),
            Work(kernel("swiglu.fwd", tokens=rows, width=x.fc1), LAYERS),
            Work(grouped_gemm("experts.linear_fc2.fprop", x, rows, h, x.ffn), LAYERS, fc2[0], fc2[1:])]


def _grouped_backward(sh: Shapes, prefix: str) -> list[Work]:
    x, h, rows = sh.moe, sh.hidden, sh.moe.grouped_rows
    work = []
    for linear, out, inp in (("linear_fc2", h, x.ffn), ("linear_fc1", x.fc1, h)):
        params = _expert_params(sh, prefix, linear)
        work += [Work(grouped_gemm(f"experts.{linear}.dgrad", x, rows, inp, out), LAYERS),
                 Work(grouped_gemm(f"experts.{linear}.wgrad", x, out, inp, rows), LAYERS, params[0], params[1:])]
        if linear == "linear_fc2":
            work.append(Work(kernel("swiglu.bwd", tokens=rows, width=x.fc1), LAYERS))
    return work


def _expert_params(sh: Shapes, prefix: str, linear: str) -> tuple[str, ...]:
    """Every local expert's weight of one linear (EP rank 0's global names), all used, and final, together."""
    return tuple(f"{prefix}mlp.experts.{i}.{linear}.weight" for i in range(sh.moe.local_experts))


def moe_forward(sh: Shapes, prefix: str) -> list[Work]:
    """Router, permute, dispatch, each local expert's SwiGLU MLP at its rows (or the grouped GEMMs over all of
    them), combine, unpermute (module docstring)."""
    x, h = sh.moe, sh.hidden
    work = [Work(_gemm("router.fprop", x.tokens, x.experts, h), LAYERS, prefix + "mlp.router.weight"),
            Work(_router_topk(x, "fwd"), LAYERS), Work(_moe_copy(sh, "moe.permute.fwd"), LAYERS),
            *_ep(sh, counts=True), *_ep(sh)]
    if x.grouped:
        work += _grouped_forward(sh, prefix)
    else:
        for rows, e in _experts(sh, prefix):
            work += [Work(_gemm("linear_fc1.fprop", rows, x.fc1, h), LAYERS, e + "linear_fc1.weight"),
                     Work(kernel("swiglu.fwd", tokens=rows, width=x.fc1), LAYERS),
                     Work(_gemm("linear_fc2.fprop", rows, h, x.ffn), LAYERS, e + "linear_fc2.weight")]
    return work + [*_ep(sh), Work(_moe_copy(sh, "moe.unpermute.fwd"), LAYERS)]


def moe_backward(sh: Shapes, prefix: str) -> list[Work]:
    """The MoE layer's forward in reverse: each all-to-all's backward is one of the same size the other way."""
    x, h = sh.moe, sh.hidden
    work = [Work(_moe_copy(sh, "moe.unpermute.bwd"), LAYERS), *_ep(sh)]
    if x.grouped:
        work += _grouped_backward(sh, prefix)
    else:
        for rows, e in reversed(_experts(sh, prefix)):
            work += [*_linear_backward(sh, "linear_fc2", h, x.ffn, e + "linear_fc2.weight", False, rows=rows),
                     Work(kernel("swiglu.bwd", tokens=rows, width=x.fc1), LAYERS),
                     *_linear_backward(sh, "linear_fc1", x.fc1, h, e + "linear_fc1.weight", False, rows=rows)]
    return work + [*_ep(sh), Work(_moe_copy(sh, "moe.permute.bwd"), LAYERS),
                   Work(_router_topk(x, "bwd"), LAYERS),
                   *_linear_backward(sh, "router", x.experts, h, prefix + "mlp.router.weight", False,
                                     rows=x.tokens)]


def _linear_backward(sh: Shapes, name: str, out: int, inp: int, param: str | None, column: bool,
                     term: str = LAYERS, rows: int | None = None) -> list[Work]:
    """dgrad then wgrad in one autograd Function (over `rows` rows: an expert's, the router's; default the
    layer's tokens); a column-parallel linear under SP re-gathers its saved input first and reduce-scatters its
    input gradient before the wgrad; without SP its input gradient is all-reduced after."""
    t = sh.tokens if rows is None else rows
    dgrad = Work(_gemm(f"{name}.dgrad", t, inp, out), term)
    wgrad = Work(_gemm(f"{name}.wgrad", out, inp, t), term, param)
    if not column:
        return [dgrad, wgrad]
    if sh.sequence_parallel:
        return [*_tp(sh, "all_gather"), dgrad, *_tp(sh, "reduce_scatter"), wgrad]
    return [dgrad, wgrad, *_tp(sh, "all_reduce")]


def layer_backward(sh: Shapes, prefix: str, selective: bool) -> list[Work]:
    h = sh.hidden
    conj = _in_gather(sh)  # the conjugate of a forward reduce-scatter (identity for a forward all-reduce)
    rerun = core_attention(sh, "fwd", RECOMPUTE) if selective else []
    mlp = moe_backward(sh, prefix) if sh.moe else [
        *conj, *_linear_backward(sh, "linear_fc2", h, sh.ffn, prefix + "mlp.linear_fc2.weight", False),
        _activation(sh, "bwd"), *_linear_backward(sh, "linear_fc1", sh.fc1, h, prefix + "mlp.linear_fc1.weight", True)]
    return [*mlp, Work(_norm(sh, "bwd"), LAYERS, prefix + "pre_mlp_layernorm.weight"), Work(_residual(sh), LAYERS),
            *conj, *_linear_backward(sh, "linear_proj", h, sh.query, prefix + "self_attention.linear_proj.weight",
                                     False), *rerun,
            *core_attention(sh, "bwd"), *_rope(sh, "bwd"),
            *_linear_backward(sh, "linear_qkv", sh.qkv, h, prefix + "self_attention.linear_qkv.weight", True),
            Work(_norm(sh, "bwd"), LAYERS, prefix + "input_layernorm.weight"), Work(_residual(sh), LAYERS)]


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
    return [Work(kernel("embedding.fwd", tokens=sh.tokens, vocab=sh.vocab, hidden=sh.hidden), "embedding",
                 EMBEDDING), *reduce]


def embedding_backward(sh: Shapes) -> list[Work]:
    return [*_in_gather(sh), Work(kernel("embedding.bwd", tokens=sh.tokens, vocab=sh.vocab, hidden=sh.hidden),
                                  "embedding", EMBEDDING)]


def head_forward(sh: Shapes, weight: str | None) -> list[Work]:
    """Final norm, output layer (its input gathered under SP inside the linear) and the vocab-parallel loss."""
    ce_bytes = 4 * sh.tokens
    ce = [Work(Collective("tp", "all_reduce", ce_bytes), TP_COMM)] * 3 if sh.tp > 1 else []
    return [Work(_norm(sh, "fwd"), "final_norm", FINAL_NORM), *_in_gather(sh),
            _fprop(sh, "output_layer", sh.vocab, sh.hidden, weight, "output_layer"),
            Work(kernel("cross_entropy.fwd", tokens=sh.tokens, vocab=sh.vocab), "cross_entropy"), *ce]


def head_backward(sh: Shapes, weight: str | None) -> list[Work]:
    """The loss's and the output layer's backward; with the loss fused over chunks of tokens the logits are first
    recomputed (the output layer's fprop once more: the engine interleaves it chunk by chunk with the rest, which
    sums to the whole micro-batch's kernels), the input re-gathered before it under SP and its gradient
    reduce-scattered (or all-reduced) after the chunks."""
    loss = Work(kernel("cross_entropy.bwd", tokens=sh.tokens, vocab=sh.vocab), "cross_entropy")
    norm = Work(_norm(sh, "bwd"), "final_norm", FINAL_NORM)
    if not sh.linear_cross_entropy:
        return [loss, *_linear_backward(sh, "output_layer", sh.vocab, sh.hidden, weight, True, "output_layer"), norm]
    gemms = _linear_backward(sh, "output_layer", sh.vocab, sh.hidden, weight, False, "output_layer")
    gather, reduce = ((_tp(sh, "all_gather"), _tp(sh, "reduce_scatter")) if sh.sequence_parallel
                      else ([], _tp(sh, "all_reduce")))
    return [*gather, _fprop(sh, "output_layer", sh.vocab, sh.hidden, None, "output_layer"), loss, *gemms, *reduce,
            norm]


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


def chunk_forward(cfg: RunConfig, pp_rank: int, chunk: int) -> list[Work]:
    sh = Shapes.of(cfg)
    first, last = chunk_ends(cfg, pp_rank, chunk)
    work = embedding_forward(sh) if first else []
    for layer in chunk_layers(cfg, pp_rank, chunk):
        work += layer_forward(sh, f"decoder.layers.{layer}.")
    work += head_forward(sh, output_param(cfg, pp_rank, chunk)) if last else []
    return _with_companions(cfg, pp_rank, chunk, work)


def chunk_backward(cfg: RunConfig, pp_rank: int, chunk: int) -> list[Work]:
    sh = Shapes.of(cfg)
    first, last = chunk_ends(cfg, pp_rank, chunk)
    selective = cfg.recompute.recompute_granularity == "selective"
    work = head_backward(sh, output_param(cfg, pp_rank, chunk)) if last else []
    layers, groups, start = list(chunk_layers(cfg, pp_rank, chunk)), [], 0
    for count, checkpointed in checkpoint_groups(cfg):
        groups.append((layers[start:start + count], checkpointed))
        start += count
    for group, checkpointed in reversed(groups):
        work += recomputed(sh, group) if checkpointed else []
        for layer in reversed(group):
            work += layer_backward(sh, f"decoder.layers.{layer}.", selective)
    work += embedding_backward(sh) if first else []
    return _with_companions(cfg, pp_rank, chunk, work)


def kernels(cfg: RunConfig, pp_rank: int) -> set[Kernel]:
    """Every distinct kernel a pipeline rank runs in a step (all its chunks, both passes)."""
    passes = [chunk_forward(cfg, pp_rank, c) + chunk_backward(cfg, pp_rank, c) for c in range(num_chunks(cfg))]
    return {w.op for work in passes for w in work if isinstance(w.op, Kernel)}
