"""Process groups: which ranks share a TP, CP, DP or PP group, and this rank's handles to them.

`RankGenerator` is pure (no torch.distributed): ranks are laid out on a grid whose axes are named by an order string,
first name varying fastest, so with the default "tp-cp-ep-dp-pp" a rank is
    rank = tp + T*(cp + C*(ep + E*(dp + D*pp)))
and the group of a set of axes is every rank reached by moving along those axes with the other coordinates fixed.
This yields the same lists as Megatron Core's generate_masked_orthogonal_rank_groups(), including the enumeration
order of the groups (the fixed coordinates counted with the first fixed axis fastest).

`ParallelState` replaces Megatron's module-global parallel_state: it is built once per process, after
init_process_group, and passed explicitly to every layer that communicates.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any

from common.errors import ConfigError
from probes.probe_set import NullProbeSet
from probes.protocol import ProbeSetProtocol

AXES = ("tp", "cp", "ep", "dp", "pp")


class RankGenerator:
    def __init__(self, tp: int, ep: int, dp: int, pp: int, cp: int, order: str = "tp-cp-ep-dp-pp",
                 world_size: int | None = None):
        self.sizes = {"tp": tp, "cp": cp, "ep": ep, "dp": dp, "pp": pp}
        for axis, size in self.sizes.items():
            if size < 1:
                raise ConfigError(f"{axis} size must be >= 1, got {size}")
        self.order = _full_order(order, self.sizes)
        self.world_size = math.prod(self.sizes.values())
        if world_size is not None and world_size != self.world_size:
            raise ConfigError(f"world size {world_size} != tp {tp} x cp {cp} x ep {ep} x dp {dp} x pp {pp}")
        self.strides: dict[str, int] = {}
        stride = 1
        for axis in self.order:
            self.strides[axis] = stride
            stride *= self.sizes[axis]

    def coordinates(self, rank: int) -> dict[str, int]:
        if not 0 <= rank < self.world_size:
            raise ConfigError(f"rank {rank} is outside the world of {self.world_size} ranks")
        return {axis: (rank // self.strides[axis]) % self.sizes[axis] for axis in AXES}

    def get_ranks(self, token: str) -> list[list[int]]:
        """All groups spanned by the axes in `token` (e.g. "tp", "dp-cp", "tp-pp")."""
        varying = [a for a in self.order if a in token.split("-")]
        fixed = [a for a in self.order if a not in varying]
        groups = []
        for fixed_coords in _counting(fixed, self.sizes):
            base = sum(c * self.strides[a] for a, c in zip(fixed, fixed_coords))
            groups.append([base + sum(c * self.strides[a] for a, c in zip(varying, coords))
                           for coords in _counting(varying, self.sizes)])
        return groups


def _full_order(order: str, sizes: dict[str, int]) -> list[str]:
    """The order's axes with every axis it leaves out appended, as Megatron's RankGenerator does: leaving an axis out
    is allowed only when its size is 1 (it does not change any rank's place)."""
    named = order.lower().split("-")
    if len(set(named)) != len(named) or not set(named) <= set(AXES):
        raise ConfigError(f"order {order!r} must name axes of {'-'.join(AXES)}, each at most once")
    for axis in AXES:
        if axis not in named and sizes[axis] != 1:
            raise ConfigError(f"order {order!r} leaves out {axis}, whose size is {sizes[axis]} (only axes of size 1 "
                              "may be left out)")
    return named + [axis for axis in AXES if axis not in named]


def _counting(axes: list[str], sizes: dict[str, int]):
    """Coordinate tuples over `axes`, first axis fastest (itertools.product varies the last fastest)."""
    for reversed_coords in itertools.product(*(range(sizes[a]) for a in reversed(axes))):
        yield tuple(reversed(reversed_coords))


def rank_generator_for(world_size: int, tp: int, pp: int, cp: int = 1, order: str = "tp-cp-ep-dp-pp") -> RankGenerator:
    model_parallel = tp * pp * cp
    if model_parallel < 1 or world_size % model_parallel:
        raise ConfigError(f"world size {world_size} is not divisible by tp {tp} x pp {pp} x cp {cp}")
    return RankGenerator(tp=tp, ep=1, dp=world_size // model_parallel, pp=pp, cp=cp, order=order)


def expert_rank_generator_for(world_size: int, tp: int, pp: int, ep: int,
                              order: str = "tp-cp-ep-dp-pp") -> RankGenerator:
    """Megatron's expert grid: tp (the expert tensor-parallel size, tp here) x ep x expert-dp x pp, no cp axis (cp is
    1 on it, so the same order string serves), expert-dp = world / (tp x ep x pp). Its pp groups equal the dense
    grid's, so a rank holds the same layers in both."""
    expert_parallel = tp * ep * pp
    if expert_parallel < 1 or world_size % expert_parallel:
        raise ConfigError(f"world size {world_size} is not divisible by tp {tp} x ep {ep} x pp {pp}")
    return RankGenerator(tp=tp, ep=ep, dp=world_size // expert_parallel, pp=pp, cp=1, order=order)


def expert_group_lists(gen: RankGenerator) -> dict[str, list[list[int]]]:
    """The expert groups, from the expert grid: ep (the all-to-all), expt_dp (expert gradients are reduced over it),
    expt_mp = tp-ep-pp (the ranks whose expert parameters all differ: the grad norm sums over it)."""
    return {"ep": gen.get_ranks("ep"), "expt_dp": gen.get_ranks("dp"), "expt_mp": gen.get_ranks("tp-ep-pp")}


def group_lists(gen: RankGenerator) -> dict[str, list[list[int]]]:
    """Every dense group kind this engine creates, as rank lists; embedding/position follow Megatron's pp-group
    ends."""
    pp_groups = gen.get_ranks("pp")
    return {
        "tp": gen.get_ranks("tp"),
        "cp": gen.get_ranks("cp"),
        "dp": gen.get_ranks("dp"),
        "dp_cp": gen.get_ranks("dp-cp"),
        "pp": pp_groups,
        "mp": gen.get_ranks("tp-pp"),
        "embedding": [sorted({g[0], g[-1]}) for g in pp_groups],
        "position": [[g[0]] for g in pp_groups],
    }


@dataclass(frozen=True)
class LayoutGroup:
    """A process group as the buffer layout and the optimizer's shards read it (its size and this rank's index in
    it, ProcessGroup's size() / rank()) with no communicator behind it: a group of one rank, over which every
    collective is the identity, so none is ever issued; or a saved run's group rebuilt on the meta device
    (engine/checkpoint_reshard.py), through which nothing communicates. torch.distributed refuses it as a group, so
    a collective issued over it by mistake fails at once instead of running over WORLD."""
    members: int
    index: int

    def size(self) -> int:
        return self.members

    def rank(self) -> int:
        return self.index


@dataclass(frozen=True)
class GroupView:
    """One process group as the layers that communicate over it need it: the handle, its size, this rank's index in
    it, and the probes its collectives report to. Built once per model from ParallelState, so the hot path reads
    plain attributes (no dist.get_world_size calls), and a group of one is built without torch.distributed (its
    handle is then never used)."""
    group: Any
    size: int
    rank: int
    probes: ProbeSetProtocol = NullProbeSet()

    @classmethod
    def of(cls, parallel_state: Any, kind: str, probes: ProbeSetProtocol | None = None) -> "GroupView":
        """The `kind` group ("tp", "ep", ...) of a ParallelState: its handle (None where the engine built none) and
        the state's `{kind}_size` / `{kind}_rank`."""
        return cls(group=parallel_state.groups.get(kind), size=getattr(parallel_state, f"{kind}_size"),
                   rank=getattr(parallel_state, f"{kind}_rank"),
                   probes=probes if probes is not None else NullProbeSet())


@dataclass
class ParallelState:
    """This process's place in the grid: sizes, coordinates, and one torch ProcessGroup per group kind."""
    rank: int
    world_size: int
    tp_size: int
    pp_size: int
    dp_size: int
    cp_size: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    cp_rank: int
    ep_size: int = 1
    ep_rank: int = 0
    expert_dp_size: int = 1  # ranks holding the same experts, world / (tp x ep x pp); 1 without experts
    ranks: dict[str, list[int]] = field(default_factory=dict)  # this rank's group (global ranks) per kind
    # kind -> a torch.distributed ProcessGroup, or a LayoutGroup for a group of one rank (no communicator); never None
    groups: dict[str, Any] = field(default_factory=dict)
    virtual_pipeline_size: int | None = None

    @classmethod
    def initialize(cls, tp: int = 1, pp: int = 1, cp: int = 1, order: str = "tp-cp-ep-dp-pp",
                   virtual_pipeline_size: int | None = None, ep: int = 1, moe: bool = False) -> "ParallelState":
        """Collective: every rank must call it; creates every group of more than one rank in the same order on every
        rank. A group of one rank gets a LayoutGroup and no torch.distributed group: with NCCL each group is a
        communicator (eagerly built when the default group has a device id: 389 MiB on an H200), and a collective
        over one rank is the identity, so the callers issue none (docs/engine.md, "Rank groups"). The expert groups
        exist only for an MoE model (moe)."""
        import torch.distributed as dist

        rank, world = dist.get_rank(), dist.get_world_size()
        gen = rank_generator_for(world, tp, pp, cp, order)
        coords = gen.coordinates(rank)
        kinds = group_lists(gen)
        expert = expert_rank_generator_for(world, tp, pp, ep, order) if moe else None
        if expert is not None:
            kinds.update(expert_group_lists(expert))
        mine: dict[str, list[int]] = {}
        handles: dict[str, Any] = {}
        for kind, lists in kinds.items():
            for ranks in lists:
                # Every rank sees the same lists, so every rank skips the same groups: the creation order holds.
                handle = dist.new_group(ranks) if len(ranks) > 1 else LayoutGroup(1, 0)
                if rank in ranks:
                    mine[kind], handles[kind] = ranks, handle
        return cls(rank=rank, world_size=world, tp_size=tp, pp_size=pp, dp_size=gen.sizes["dp"], cp_size=cp,
                   tp_rank=coords["tp"], pp_rank=coords["pp"], dp_rank=coords["dp"], cp_rank=coords["cp"],
                   ep_size=ep, ep_rank=expert.coordinates(rank)["ep"] if expert else 0,
                   expert_dp_size=expert.sizes["dp"] if expert else 1,
                   ranks=mine, groups=handles, virtual_pipeline_size=virtual_pipeline_size)

    @classmethod
    def from_run_config(cls, run_config: Any) -> "ParallelState":
        """initialize() with a RunConfig's layout (common.config): what `train` and the parity tests build."""
        p = run_config.parallel
        return cls.initialize(p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size,
                              p.order, p.virtual_pipeline_model_parallel_size, ep=p.expert_model_parallel_size,
                              moe=run_config.model.is_moe)

    @property
    def is_pipeline_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_pipeline_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    @property
    def pipeline_next_rank(self) -> int:
        return self.ranks["pp"][(self.pp_rank + 1) % self.pp_size]

    @property
    def pipeline_prev_rank(self) -> int:
        return self.ranks["pp"][(self.pp_rank - 1) % self.pp_size]

    @property
    def coordinates(self) -> dict[str, int]:
        return {"tp": self.tp_rank, "cp": self.cp_rank, "dp": self.dp_rank, "pp": self.pp_rank}
