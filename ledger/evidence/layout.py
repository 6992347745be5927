"""Rank groups as the ledger derives them, independently of the engine.

Why a second derivation: if the ledger asked the engine's RankGenerator which ranks share a group, an engine bug would
reconcile as "ok". So this follows Megatron Core's own construction (generate_masked_orthogonal_rank_groups): the sizes
in the order's sequence give prefix products (strides); a mask picks the group's axes; group g and member r decompose
into index vectors over the unmasked / masked shapes; a rank is their inner product with the strides. Imports common.*
only (no engine, probes or torch).
"""
from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass

from common.config import MAX_WORLD_SIZE
from common.errors import ConfigError

AXES = ("tp", "cp", "ep", "dp", "pp")
DEFAULT_ORDER = "tp-cp-ep-dp-pp"


def _prefix_product(shape: list[int]) -> list[int]:
    return [1, *itertools.accumulate(shape, operator.mul)]


def _decompose(index: int, shape: list[int], strides: list[int] | None = None) -> list[int]:
    """Index vector of `index` over `shape`, first entry fastest (Megatron's decompose)."""
    return [(index // stride) % size for size, stride in zip(shape, strides or _prefix_product(shape))]


def _inner(a: list[int], b: list[int]) -> int:
    return sum(x * y for x, y in zip(a, b))


def normalize_order(order: str, sizes: dict[str, int]) -> list[str]:
    """The full axis sequence of `order`, as Megatron's RankGenerator reads it: an axis of size 1 may be left out
    (it is appended at the end, where it changes nothing); leaving out an axis of size > 1 is an error."""
    names = [n.strip() for n in order.lower().split("-")]
    if any(n not in AXES for n in names) or len(set(names)) != len(names):
        raise ConfigError(f"order {order!r} must name axes among {'-'.join(AXES)}, each at most once")
    for axis in AXES:
        if axis not in names:
            if sizes.get(axis, 1) != 1:
                raise ConfigError(f"order {order!r} omits {axis} of size {sizes[axis]}; an order may leave out "
                                  f"only axes of size 1")
            names.append(axis)
    return names


@dataclass(frozen=True)
class Layout:
    """World size, the size of each axis and their order. `of` is the one place in the ledger that computes dp
    from the world size. ep is an axis of this grid, but Megatron lays experts out on a second generator
    (`expert_layout`), so callers of the dense groups leave ep at 1."""
    world_size: int
    tp: int
    cp: int
    ep: int
    dp: int
    pp: int
    order: str = DEFAULT_ORDER
    vpp: int = 1

    def __post_init__(self) -> None:
        for name, size in (("world size", self.world_size), ("vpp", self.vpp), *self.sizes.items()):
            if size < 1:
                raise ConfigError(f"{name} must be >= 1, got {size}")
        if self.world_size > MAX_WORLD_SIZE:  # the group lists enumerate every rank
            raise ConfigError(f"world size {self.world_size:,} is beyond the largest supported {MAX_WORLD_SIZE:,}")
        if math.prod(self.sizes.values()) != self.world_size:
            product = " x ".join(f"{a} {s}" for a, s in self.sizes.items())
            raise ConfigError(f"world size {self.world_size} != {product}")
        object.__setattr__(self, "order", "-".join(normalize_order(self.order, self.sizes)))

    @classmethod
    def of(cls, world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, ep: int = 1,
           order: str = DEFAULT_ORDER, vpp: int = 1) -> "Layout":
        """dp is what is left of the world once tp, pp, cp (and ep, if given) are placed."""
        for name, size in {"world size": world_size, "tp": tp, "pp": pp, "cp": cp, "ep": ep, "vpp": vpp}.items():
            if size < 1:
                raise ConfigError(f"{name} must be >= 1, got {size}")
        if world_size % (tp * pp * cp * ep):
            parts = f"tp {tp} x pp {pp} x cp {cp}" + (f" x ep {ep}" if ep != 1 else "")
            raise ConfigError(f"world size {world_size} is not divisible by {parts} = {tp * pp * cp * ep}")
        return cls(world_size, tp=tp, cp=cp, ep=ep, dp=world_size // (tp * pp * cp * ep), pp=pp, order=order, vpp=vpp)

    @property
    def sizes(self) -> dict[str, int]:
        return {"tp": self.tp, "cp": self.cp, "ep": self.ep, "dp": self.dp, "pp": self.pp}


def rank_groups(layout: Layout, token: str) -> list[list[int]]:
    """Every group spanned by the axes named in `token` ("tp", "dp-cp", ...), in Megatron's enumeration order."""
    axes = layout.order.split("-")
    names = token.lower().split("-")
    if any(n not in axes for n in names):
        raise ConfigError(f"group token {token!r} must name axes among {'-'.join(AXES)}")
    shape = [layout.sizes[a] for a in axes]
    mask = [a in names for a in axes]
    strides = _prefix_product(shape)[:-1]

    def select(values: list[int], keep: bool) -> list[int]:
        return [x for x, m in zip(values, mask) if m == keep]

    in_shape, in_stride, out_shape, out_stride = (select(shape, True), select(strides, True),
                                                  select(shape, False), select(strides, False))
    size = math.prod(in_shape)
    # The member and group offsets do not depend on each other: compute each once, then add them.
    in_prefix, out_prefix = _prefix_product(in_shape), _prefix_product(out_shape)
    members = [_inner(_decompose(r, in_shape, in_prefix), in_stride) for r in range(size)]
    bases = [_inner(_decompose(g, out_shape, out_prefix), out_stride) for g in range(layout.world_size // size)]
    return [[base + member for member in members] for base in bases]


def group_lists(layout: Layout) -> dict[str, list[list[int]]]:
    """Every group kind the engine should create. embedding: both ends of each pp group; position: its first."""
    pp = rank_groups(layout, "pp")
    return {"tp": rank_groups(layout, "tp"), "cp": rank_groups(layout, "cp"), "dp": rank_groups(layout, "dp"),
            "dp_cp": rank_groups(layout, "dp-cp"), "pp": pp, "mp": rank_groups(layout, "tp-pp"),
            "embedding": [sorted({g[0], g[-1]}) for g in pp], "position": [[g[0]] for g in pp]}


def coordinates(layout: Layout, rank: int) -> dict[str, int]:
    """The coordinate of `rank` along each axis: its index vector over the ordered shape."""
    if not 0 <= rank < layout.world_size:
        raise ConfigError(f"rank {rank} is outside the world of {layout.world_size} ranks")
    axes = layout.order.split("-")
    vector = dict(zip(axes, _decompose(rank, [layout.sizes[a] for a in axes])))
    return {a: vector[a] for a in AXES}


def rank_groups_of(layout: Layout, rank: int) -> dict[str, list[int]]:
    """The group of each kind that contains `rank`; a kind with no group holding it (embedding or position on a
    middle pipeline stage) is left out, as the engine leaves it out of ParallelState.ranks."""
    coordinates(layout, rank)  # ConfigError outside the world
    return {kind: group for kind, groups in group_lists(layout).items() for group in groups if rank in group}


def expert_layout(world_size: int, tp: int = 1, pp: int = 1, ep: int = 1, order: str = DEFAULT_ORDER) -> Layout:
    """Megatron's second grid, for experts: tp (the expert tensor-parallel size, tp by default) x ep x expert-dp x
    pp with no cp axis (cp folds into expert-dp), expert-dp = world / (tp x ep x pp), the same order string. Its pp
    groups are the dense grid's, so a rank holds the same layers on both."""
    if ep < 1:
        raise ConfigError(f"ep must be >= 1, got {ep}")
    if tp < 1 or pp < 1 or world_size % (tp * ep * pp):
        raise ConfigError(f"world size {world_size} is not divisible by tp {tp} x ep {ep} x pp {pp} = {tp * ep * pp} "
                          "(the expert grid)")
    return Layout(world_size, tp=tp, cp=1, ep=ep, dp=world_size // (tp * ep * pp), pp=pp, order=order)


def expert_group_lists(layout: Layout) -> dict[str, list[list[int]]]:
    """The expert groups of an expert_layout: ep (the token all-to-all), expt_dp (expert gradients are reduced over
    it) and expt_mp = tp-ep-pp (ranks whose expert parameters all differ: the grad norm's expert part sums over it)."""
    return {"ep": rank_groups(layout, "ep"), "expt_dp": rank_groups(layout, "dp"),
            "expt_mp": rank_groups(layout, "tp-ep-pp")}


def expert_coordinates(layout: Layout, rank: int) -> dict[str, int]:
    """`rank`'s place on an expert_layout: its ep and expert-dp coordinates."""
    coords = coordinates(layout, rank)
    return {"ep": coords["ep"], "expt_dp": coords["dp"]}


# The kinds a collective is named by, in the order a rank list several of them share resolves to. mp (TP x PP x CP)
# is the grad norm's group; last, since its ranks are another kind's whenever only one dimension is parallel.
GROUP_KINDS = ("tp", "dp", "pp", "embedding", "mp")


def group_kind(groups: dict[str, tuple[int, ...]], ranks: tuple[int, ...] | None, op: str | None = None,
               issued_as: str | None = None) -> str:
    """"dp" / "tp" / "pp" / "embedding" / "mp" for a collective's rank list, "other" for any other group, "unknown"
    when no ranks are known. A rank list that is several kinds' goes to the one the evidence names (`issued_as`: the
    engine range the collective was issued in, ledger.evidence.trace_groups), else to the first in GROUP_KINDS order,
    except that under PP2 the pipeline group is also the embedding group, whose only collective is the tied
    embedding's grad all-reduce: an all-reduce there is the embedding's unless the evidence says it was issued
    outside the embedding's range (`issued_as` ""); point-to-point, the loss broadcast and every other op are the
    pipeline's."""
    if ranks is None:
        return "unknown"
    key = tuple(sorted(ranks))
    kinds = [kind for kind in GROUP_KINDS if groups.get(kind) == key]
    if issued_as in kinds:
        return issued_as
    if "pp" in kinds and "embedding" in kinds:
        kinds.remove("pp" if op == "all_reduce" and issued_as is None else "embedding")
    return kinds[0] if kinds else "other"
