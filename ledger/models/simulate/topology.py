"""Which parallel groups stay inside a node and which cross nodes, and what one collective over each costs.

Placement: Megatron numbers ranks along its order (default tp-cp-ep-dp-pp, ledger/evidence/layout.py): the first axis
varies fastest, so an axis's stride is the product of the sizes before it, and a group of that axis is
{base + j x stride, j < size}. Ranks fill nodes in order (node = rank // gpus_per_node), as torchrun and Slurm launch
them. For each kind (tp, dp, pp; cp and dp_cp when cp > 1; embedding: the first and last rank of each pp group) the
worst group gives `nodes`, the most nodes one group spans, and `per_node`, the fewest of one group's ranks on one
node. Whether a group of base b spans k nodes depends only on b mod gpus_per_node, so at most gpus_per_node bases
are looked at, whatever the world size. Under context parallelism the cp group carries ring attention's K/V
messages (a send/recv to the next rank of the ring, priced as a pipeline send is: one step, one NIC across nodes)
and the DP collectives run over dp_cp (Megatron's group of the dp x cp ranks holding the same parameters).
Mixture of experts (ep > 1): the ep group lives on Megatron's expert grid (its own rank generator: tp-ep-dp-pp with
the expert tp = tp and cp folded into the expert dp), where an EP group's members are tp apart: EP groups inside a
node use NVLink, across nodes the NICs.

Cost (NCCL's own model, src/graph/tuning.cc, with the link figures of the hardware file):
    t = base latency + intra steps x NVLink hop + inter steps x network hop + S x bus_factor / bus bandwidth
  over a ring of n ranks across N nodes: 2(n-1) steps of which 2(N-1) cross nodes for an all-reduce, n-1 and N-1 for
  all-gather and reduce-scatter, one step for a send/recv (crossing when the two ranks are on two nodes). An
  all-reduce across nodes may instead use NCCL's tree: 2((n/N - 1) NVLink hops + ceil(log2 N) network hops) of
  latency at 0.9 of the ring's bandwidth. Each collective takes the fastest of {ring, tree} x {LL, Simple} (LL:
  small latency, a fraction of the bandwidth; Simple: the reverse), as NCCL's tuner picks.
  Bus bandwidth: inside a node the NVLink/NVSwitch bus bandwidth (send/recv: the measured point-to-point one);
  across nodes a ring's inter-node hops are spread over one NIC per GPU of the group on a node, so
  min(NVLink bus bandwidth, per_node x NIC line rate x efficiency) (send/recv: one NIC). bus_factor is
  ledger/models/formulas/nccl_bw.py's (nccl-tests' convention, the one the time model's LinkFit uses).
  All-to-all: every pair exchanges at once (NCCL posts all its sends and receives together), so its latency is one
  step (a network hop when the group crosses nodes); of a rank's buffer S, S (q - 1)/n goes to the q - 1 other
  ranks of its node over NVLink and S (n - q)/n to other nodes through its own NIC (q = per_node), the slower of the
  two setting the time: an effective bus bandwidth of ((n - 1)/n) / max((q - 1)/(n B_nvlink), (n - q)/(n B_nic)).
Not modelled: SHARP / NVLS in-network reductions, PAT, rail-optimised versus fat-tree fabrics, congestion between
concurrent groups beyond the per-GPU NIC split, a group whose ranks are unevenly spread over nodes beyond its worst
node.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from common.config import RunConfig
from ledger.evidence.layout import Layout, expert_layout
from ledger.models.formulas.nccl_bw import bus_factor
from ledger.models.simulate.hardware import Hardware, Protocol
from ledger.models.time_model.comm import CommModel

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "send_recv", "all_to_all")
TREE_BANDWIDTH = 0.9  # NCCL's tree bus bandwidth relative to the ring's (tuning.cc: busBw * .9)
NVLINK, NETWORK = "NVLink", "network"


@dataclass(frozen=True)
class GroupSpan:
    kind: str  # tp, cp, dp, dp_cp, pp, embedding, ep
    size: int
    nodes: int  # the most nodes one group of this kind spans
    per_node: int  # the fewest ranks of one group on one node

    @property
    def link(self) -> str:
        """The link that bounds the group's collectives."""
        return NVLINK if self.nodes == 1 else NETWORK


def _strides(layout: Layout) -> dict[str, int]:
    strides, step = {}, 1
    for axis in layout.order.split("-"):
        strides[axis] = step
        step *= layout.sizes[axis]
    return strides


def _bases_mod(stride: int, span: int, count: int, g: int) -> set[int]:
    """b mod g over the group bases b = lo + hi x span (lo < stride, hi < count): every residue when stride >= g."""
    if stride >= g:
        return set(range(g))
    return {(lo + hi * span) % g for lo in range(stride) for hi in range(min(count, g))}


def _span_of(offsets: list[int], residues: set[int], g: int) -> tuple[int, int]:
    """(most nodes, fewest ranks on one node) over groups whose base has each residue mod g."""
    most, fewest = 1, len(offsets)
    for r in residues:
        per_node: dict[int, int] = {}
        for off in offsets:
            node = (r + off) // g
            per_node[node] = per_node.get(node, 0) + 1
        most, fewest = max(most, len(per_node)), min(fewest, min(per_node.values()))
    return most, fewest


def group_spans(cfg: RunConfig, gpus_per_node: int) -> dict[str, GroupSpan]:
    """The span of each group kind of cfg's layout on nodes of `gpus_per_node` GPUs (cp, dp_cp only when cp > 1)."""
    p = cfg.parallel
    spans = dict(_spans(p.world_size, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                        p.context_parallel_size, p.order, gpus_per_node))
    if cfg.model.is_moe and p.expert_model_parallel_size > 1:
        spans["ep"] = _ep_span(p.world_size, p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                               p.expert_model_parallel_size, p.order, gpus_per_node)
    return spans


@lru_cache(maxsize=4096)
def _ep_span(world: int, tp: int, pp: int, ep: int, order: str, g: int) -> GroupSpan:
    """The ep group on the expert grid (module docstring): cp 1, the expert dp taking what tp x ep x pp leaves."""
    layout = expert_layout(world, tp=tp, pp=pp, ep=ep, order=order)
    stride = _strides(layout)["ep"]
    residues = _bases_mod(stride, stride * ep, world // (stride * ep), g)
    return GroupSpan("ep", ep, *_span_of([j * stride for j in range(ep)], residues, g))


def _dp_cp_span(layout: Layout, strides: dict[str, int], g: int) -> GroupSpan:
    """Megatron's dp_cp group (the ranks of every dp and cp coordinate at fixed tp, ep, pp: what the DP collectives
    run over under context parallelism), counted over the residues of its bases mod g (its members need not be one
    arithmetic progression when the order does not put cp and dp side by side)."""
    offsets = sorted(c * strides["cp"] + d * strides["dp"] for c in range(layout.cp) for d in range(layout.dp))
    others = [(strides[a], layout.sizes[a]) for a in ("tp", "ep", "pp")]
    residues = {0}
    for stride, size in others:
        residues = {(r + j * stride) % g for r in residues for j in range(size)}
    return GroupSpan("dp_cp", layout.cp * layout.dp, *_span_of(offsets, residues, g))


@lru_cache(maxsize=4096)
def _spans(world: int, tp: int, pp: int, cp: int, order: str, g: int) -> tuple[tuple[str, GroupSpan], ...]:
    layout = Layout.of(world, tp=tp, pp=pp, cp=cp, order=order)
    strides = _strides(layout)
    spans = {}
    for kind in ("tp", "cp", "dp", "pp"):
        size, stride = layout.sizes[kind], strides[kind]
        if kind == "cp" and size == 1:
            continue
        residues = _bases_mod(stride, stride * size, world // (stride * size), g)
        spans[kind] = GroupSpan(kind, size, *_span_of([j * stride for j in range(size)], residues, g))
    if cp > 1:
        spans["dp_cp"] = _dp_cp_span(layout, strides, g)
    stride = strides["pp"]
    ends = sorted({0, (pp - 1) * stride})  # the first and last stage of a pipeline
    residues = _bases_mod(stride, stride * pp, world // (stride * pp), g)
    spans["embedding"] = GroupSpan("embedding", len(ends), *_span_of(ends, residues, g))
    return tuple(spans.items())


@dataclass(frozen=True)
class TopologyLink:
    """A LinkFit-compatible price of one group kind's collectives (`seconds(kind, n, size_bytes)`), so that the time
    model's CommModel and predict_step use it unchanged."""
    span: GroupSpan
    bus_bandwidth: float  # bytes/s, collectives
    p2p_bandwidth: float  # bytes/s, send/recv
    protocols: tuple[tuple[str, Protocol], ...]
    all_to_all_bandwidth: float = 0.0  # bytes/s, an all-to-all's effective bus bandwidth (module docstring)

    @property
    def busbw(self) -> float:
        return self.bus_bandwidth

    def bandwidth(self, kind: str) -> float:
        if kind == "all_to_all":
            return self.all_to_all_bandwidth
        return self.p2p_bandwidth if kind == "send_recv" else self.bus_bandwidth

    def seconds(self, kind: str, n: int, size_bytes: float) -> float:
        if n <= 1:
            return 0.0
        nodes = min(self.span.nodes, n)
        if kind in ("send_recv", "all_to_all"):  # one step: every pair at once
            steps, inter = 1, int(nodes > 1)
        else:
            per = 2 if kind == "all_reduce" else 1
            steps, inter = per * (n - 1), per * (nodes - 1)
        moved = size_bytes * bus_factor(kind, n) / self.bandwidth(kind)
        best = math.inf
        for _, p in self.protocols:
            ring = p.base_s + (steps - inter) * p.intra_hop_s + inter * p.inter_hop_s + moved / p.bandwidth_fraction
            best = min(best, ring)
            if kind == "all_reduce" and nodes > 1:
                hops = (n // nodes - 1) * p.intra_hop_s + math.ceil(math.log2(nodes)) * p.inter_hop_s
                best = min(best, p.base_s + 2 * hops + moved / (p.bandwidth_fraction * TREE_BANDWIDTH))
        return best

    def describe(self) -> str:
        s = self.span
        where = "inside a node" if s.nodes == 1 else f"across {s.nodes} nodes, {s.per_node} rank(s) a node"
        return (f"{s.kind} group of {s.size} {where}: {s.link}, bus {self.bus_bandwidth / 1e9:.0f} GB/s, "
                f"send/recv {self.p2p_bandwidth / 1e9:.0f} GB/s")


def link_for(span: GroupSpan, hw: Hardware) -> TopologyLink:
    bus, p2p = hw.nvlink_bus_bandwidth, hw.nvlink_p2p_bandwidth
    a2a = bus
    if span.nodes > 1:
        nic = hw.nic_bandwidth * hw.nic_efficiency
        bus, p2p = min(bus, span.per_node * nic), min(p2p, nic)
        n, q = span.size, span.per_node
        a2a = ((n - 1) / n) / max((q - 1) / (n * hw.nvlink_bus_bandwidth), (n - q) / (n * nic))
    return TopologyLink(span, bus, p2p, hw.protocols, a2a)


def comm_model(cfg: RunConfig, hw: Hardware) -> CommModel:
    """One TopologyLink per (group kind, collective) of cfg's layout on hw's nodes."""
    links = {kind: link_for(span, hw) for kind, span in group_spans(cfg, hw.gpus_per_node).items()}
    return CommModel({(kind, collective): link for kind, link in links.items() for collective in COLLECTIVES})
