"""Communication volume per training step on one rank of a pipeline stage, by collective.

The details: docs/formulas.md, "What `comm.py` counts, call by call".
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from common.config import RunConfig
from common.config.pipeline_layers import stage_num_layers
from common.ops.sizes import routed_tokens
from ledger.models.formulas.activations import (
    activation_bytes,
    local_seq_length,
    recomputed_groups,
    recomputed_layer_count,
)
from ledger.models.formulas.buffer_layout import (
    dp_cp_size,
    expert_dp_size,
    expert_rank_buffers,
    rank_buffers,
)
from ledger.models.formulas.bytes_per_param import DTYPE_BYTES
from ledger.models.formulas.moe import COUNT_BYTES, layer_volume, uniform_exchange
from ledger.models.formulas.nccl_bw import bus_factor
from ledger.models.formulas.params import (
    chunk_tensors,
    embedding_copy_on_last_stage,
    num_chunks,
)

CONVENTION = ("per rank per step: size_bytes = nccl-tests size summed over calls; "
              "bytes_per_rank = size x ring bus factor")


@dataclass(frozen=True)
class Collective:
    group: str
    kind: str
    group_size: int
    dtype: str
    calls: int
    size_bytes: int

    @property
    def bytes_per_rank(self) -> float:
        return self.size_bytes * bus_factor(self.kind, self.group_size)

    def to_dict(self) -> dict:
        return {**asdict(self), "bytes_per_rank": self.bytes_per_rank}


def _add(out: dict[str, Collective], name: str, c: Collective) -> None:
    if c.group_size > 1 and c.calls > 0:
        out[name] = c


def grad_group(cfg: RunConfig) -> str:
    """The group the DP collectives run over: dp, or Megatron's dp_cp under context parallelism."""
    return "dp_cp" if cfg.parallel.context_parallel_size > 1 else "dp"


def dp_collectives(cfg: RunConfig, pp_rank: int) -> dict[str, Collective]:
    t, dp, group = cfg.train, dp_cp_size(cfg), grad_group(cfg)
    buffers = rank_buffers(cfg, pp_rank)
    numel, calls = sum(b.numel for b in buffers), sum(len(b.buckets) for b in buffers)
    out: dict[str, Collective] = {}
    gdt, pdt = t.grad_dtype, t.params_dtype
    if t.use_distributed_optimizer:
        _add(out, f"{group}.reduce_scatter.grads[{gdt}]",
             Collective(group, "reduce_scatter", dp, gdt, calls, numel * DTYPE_BYTES[gdt]))
        _add(out, f"{group}.all_gather.params[{pdt}]",
             Collective(group, "all_gather", dp, pdt, calls, numel * DTYPE_BYTES[pdt]))
    else:
        _add(out, f"{group}.all_reduce.grads[{gdt}]",
             Collective(group, "all_reduce", dp, gdt, calls, numel * DTYPE_BYTES[gdt]))
    experts, edp = expert_rank_buffers(cfg, pp_rank), expert_dp_size(cfg)
    numel, calls = sum(b.numel for b in experts), sum(len(b.buckets) for b in experts)
    if t.use_distributed_optimizer:
        _add(out, f"dp.reduce_scatter.expert_grads[{gdt}]",
             Collective("dp", "reduce_scatter", edp, gdt, calls, numel * DTYPE_BYTES[gdt]))
        _add(out, f"dp.all_gather.expert_params[{pdt}]",
             Collective("dp", "all_gather", edp, pdt, calls, numel * DTYPE_BYTES[pdt]))
    else:
        _add(out, f"dp.all_reduce.expert_grads[{gdt}]",
             Collective("dp", "all_reduce", edp, gdt, calls, numel * DTYPE_BYTES[gdt]))
    return out


def tp_collectives(cfg: RunConfig, pp_rank: int) -> dict[str, Collective]:
    """TP collectives per step (module docstring), plus what full recompute repeats: backward re-runs each
    checkpointed group's forward up to its last saved tensor (torch's checkpoint early stop), so a group of g layers
    repeats 2g all-gathers and 2g - 1 reduce-scatters under SP (2g - 1 all-reduces without), everything but its last
    fc2's output collective; selective recompute repeats SDPA alone, no collective."""
    p, m = cfg.parallel, cfg.model
    tp, sp, mb = p.tensor_model_parallel_size, p.sequence_parallel, cfg.num_microbatches
    dt = cfg.train.params_dtype
    sbh = activation_bytes(cfg) * local_seq_length(cfg) * cfg.train.micro_batch_size * m.hidden_size
    layers = stage_num_layers(cfg.parallel, cfg.model.num_layers, pp_rank)
    first, last = pp_rank == 0, pp_rank == p.pipeline_model_parallel_size - 1
    if sp:
        # Learned positions are added to the whole sequence: the embedding all-reduces, then splits its output
        # (Megatron's reduce_scatter_embeddings is off), the split's backward being the same all-gather.
        positions = first and m.learned_positions
        ag = 6 * layers + (1 if first else 0) + (2 if last else 0)
        rs = 4 * layers + (1 if first and not positions else 0) + (1 if last else 0)
        counts = {"all_gather": ag, "reduce_scatter": rs, **({"all_reduce": 1} if positions else {})}
    else:
        counts = {"all_reduce": 4 * layers + (1 if first else 0) + (1 if last else 0)}
    out: dict[str, Collective] = {}
    for kind, n in counts.items():
        _add(out, f"tp.{kind}.activations[{dt}]", Collective("tp", kind, tp, dt, n * mb, n * mb * sbh))
    groups = recomputed_groups(cfg, pp_rank)
    rerun = 2 * sum(groups) - len(groups)
    for kind, n in ({"all_gather": 2 * sum(groups), "reduce_scatter": rerun} if sp else {"all_reduce": rerun}).items():
        _add(out, f"tp.{kind}.recompute[{dt}]", Collective("tp", kind, tp, dt, n * mb, n * mb * sbh))
    if last:
        sb = local_seq_length(cfg) * cfg.train.micro_batch_size
        _add(out, "tp.all_reduce.cross_entropy[fp32]",
             Collective("tp", "all_reduce", tp, "fp32", 3 * mb, 3 * mb * 4 * sb))
    if sp:
        gdt = cfg.train.grad_dtype
        norms = sum(t.numel for c in range(num_chunks(cfg)) for t in chunk_tensors(cfg, pp_rank, c)
                    if t.sequence_parallel)
        _add(out, f"tp.all_reduce.norm_grads[{gdt}]",
             Collective("tp", "all_reduce", tp, gdt, 1, norms * DTYPE_BYTES[gdt]))
    return out


def pp_collectives(cfg: RunConfig, pp_rank: int) -> dict[str, Collective]:
    p, m = cfg.parallel, cfg.model
    pp, v = p.pipeline_model_parallel_size, num_chunks(cfg)
    sp_div = p.tensor_model_parallel_size if p.sequence_parallel else 1
    message = activation_bytes(cfg) * local_seq_length(cfg) * cfg.train.micro_batch_size * m.hidden_size // sp_div
    stages = [c * pp + pp_rank for c in range(v)]
    sends = sum(k < pp * v - 1 for k in stages) + sum(k > 0 for k in stages)  # receives: the same count
    mb, dt = cfg.num_microbatches, cfg.train.params_dtype
    out: dict[str, Collective] = {}
    for direction in ("send", "recv"):
        _add(out, f"pp.{direction}.activations_and_grads[{dt}]",
             Collective("pp", "send_recv", pp, dt, sends * mb, sends * mb * message))
    return out


def kv_block_bytes(cfg: RunConfig) -> int:
    """|KV|: one CP rank's K and V blocks on one TP rank, [s/C, b, n_kv/t, d] each, in the params' dtype."""
    m, t = cfg.model, cfg.parallel.tensor_model_parallel_size
    return 2 * activation_bytes(cfg) * local_seq_length(cfg) * cfg.train.micro_batch_size * m.kv_channels // t


def ring_messages(cp: int, forward: bool) -> list[int]:
    """Ring attention's messages of one layer's pass, in |KV| units, in send order (module docstring): forward C - 1
    K/V blocks; backward K/V, then K/V with dK/dV (2) C - 2 times, then dK/dV."""
    if cp == 1:
        return []
    return [1] * (cp - 1) if forward else [1] + [2] * (cp - 2) + [1]


def ring_passes(cfg: RunConfig, pp_rank: int) -> tuple[int, int]:
    """(layers, re-run forwards) of ring attention per micro-batch on a pipeline rank: each layer runs the ring
    forward and backward once, and recompute re-runs the forward of every layer it repeats core attention in
    (selective: all; full: the checkpointed groups')."""
    layers = stage_num_layers(cfg.parallel, cfg.model.num_layers, pp_rank)
    if cfg.recompute.recompute_granularity == "selective":
        return layers, layers
    return layers, recomputed_layer_count(cfg, pp_rank)


def cp_collectives(cfg: RunConfig, pp_rank: int) -> dict[str, Collective]:
    """Ring attention's K/V exchange per step (module docstring): per direction, the forward's K/V blocks, the
    backward's K/V blocks and dK/dV partial sums (their messages), and what recompute repeats of the forward."""
    cp, mb, dt = cfg.parallel.context_parallel_size, cfg.num_microbatches, cfg.train.params_dtype
    kv = kv_block_bytes(cfg)
    layers, rerun = ring_passes(cfg, pp_rank)
    forward, backward = ring_messages(cp, True), ring_messages(cp, False)
    out: dict[str, Collective] = {}
    for direction in ("send", "recv"):
        for what, n_layers, messages in (("kv_forward", layers, forward), ("kv_dkv_backward", layers, backward),
                                         ("kv_recompute", rerun, forward)):
            calls = n_layers * mb * len(messages)
            _add(out, f"cp.{direction}.{what}[{dt}]",
                 Collective("cp", "send_recv", cp, dt, calls, n_layers * mb * sum(messages) * kv))
    return out


def embedding_collectives(cfg: RunConfig, pp_rank: int) -> dict[str, Collective]:
    """The first and last stage each all-reduce the grad of their copy of the tied embedding, once per step."""
    pp = cfg.parallel.pipeline_model_parallel_size
    if not embedding_copy_on_last_stage(cfg) or pp_rank not in (0, pp - 1):
        return {}
    chunk = 0 if pp_rank == 0 else num_chunks(cfg) - 1
    (shared,) = [t for t in chunk_tensors(cfg, pp_rank, chunk) if t.shared_embedding]
    gdt = cfg.train.grad_dtype
    out: dict[str, Collective] = {}
    _add(out, f"embedding.all_reduce.word_embedding_grads[{gdt}]",
         Collective("embedding", "all_reduce", 2, gdt, 1, shared.numel * DTYPE_BYTES[gdt]))
    return out


def ep_collectives(cfg: RunConfig, pp_rank: int) -> dict[str, Collective]:
    """The expert-parallel all-to-alls of a step under uniform routing (ledger/models/formulas/moe.py): dispatch and
    combine rows (h values in the activations' dtype per kept assignment), forward, backward and full recompute's
    re-run, and the per-expert counts before each forward's dispatch. Not counted: the all-gather / reduce-scatter over
    TP that Megatron adds around the experts at tp > 1."""
    m, ep = cfg.model, cfg.parallel.expert_model_parallel_size
    if not m.is_moe:
        return {}
    mb, dt = cfg.num_microbatches, cfg.train.params_dtype
    row = activation_bytes(cfg) * m.hidden_size
    x = uniform_exchange(routed_tokens(cfg), m, ep)
    layers = stage_num_layers(cfg.parallel, cfg.model.num_layers, pp_rank)
    rerun = recomputed_layer_count(cfg, pp_rank)
    tokens = layer_volume(x, row * mb, mb, recomputed=False)
    size = layers * tokens.size_bytes + rerun * (x.sent + x.received) * row * mb
    calls = layers * tokens.calls + rerun * 2 * mb
    counted = layers + rerun  # forwards, each preceded by a counts exchange
    out: dict[str, Collective] = {}
    _add(out, f"ep.all_to_all.tokens[{dt}]", Collective("ep", "all_to_all", ep, dt, calls, size))
    _add(out, "ep.all_to_all.counts[int64]",
         Collective("ep", "all_to_all", ep, "int64", counted * mb, counted * mb * m.num_experts * COUNT_BYTES))
    return out


def step_collectives(cfg: RunConfig, pp_rank: int) -> dict[str, Collective]:
    return {**dp_collectives(cfg, pp_rank), **tp_collectives(cfg, pp_rank), **pp_collectives(cfg, pp_rank),
            **cp_collectives(cfg, pp_rank), **embedding_collectives(cfg, pp_rank)}
