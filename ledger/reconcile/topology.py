"""Which ranks share a TP, DP or PP group in a run, from its manifest: pure rank arithmetic (engine.parallel_state's
RankGenerator, which is torch-free), never the engine's formulas."""
from __future__ import annotations

from functools import lru_cache
from typing import Any

KINDS = ("tp", "dp", "pp")


def parallel_sizes(manifest: dict[str, Any]) -> tuple[int, int, int, int, str]:
    par = (manifest.get("config") or {}).get("parallel") or {}
    return (int(manifest["world_size"]), par.get("tensor_model_parallel_size", 1),
            par.get("pipeline_model_parallel_size", 1), par.get("context_parallel_size", 1),
            par.get("order", "tp-cp-ep-dp-pp"))


@lru_cache(maxsize=16)
def _lists(world: int, tp: int, pp: int, cp: int, order: str) -> dict[str, list[list[int]]]:
    from engine.parallel_state import group_lists, rank_generator_for

    return group_lists(rank_generator_for(world, tp, pp, cp, order))


def group_lists_of(manifest: dict[str, Any]) -> dict[str, list[list[int]]]:
    return _lists(*parallel_sizes(manifest))


def rank_groups(manifest: dict[str, Any], rank: int) -> dict[str, tuple[int, ...]]:
    """This rank's TP, DP and PP groups as sorted rank tuples."""
    lists = group_lists_of(manifest)
    return {kind: tuple(sorted(next(g for g in lists[kind] if rank in g))) for kind in KINDS}


def group_kind(groups: dict[str, tuple[int, ...]], ranks: tuple[int, ...] | None) -> str:
    """"dp" / "tp" / "pp" for a collective's rank list (DP first when a group is several kinds at once), "other"
    for any other group, "unknown" when the trace did not record the ranks (gloo)."""
    if ranks is None:
        return "unknown"
    key = tuple(sorted(ranks))
    return next((kind for kind in KINDS if groups[kind] == key), "other")


def rank_label(rank: int, coords: dict[str, int]) -> str:
    return f"rank {rank} (tp{coords.get('tp', 0)} dp{coords.get('dp', 0)} pp{coords.get('pp', 0)})"
