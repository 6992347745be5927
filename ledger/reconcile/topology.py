"""Which ranks share a TP, DP, PP or embedding group in a run, and whether the engine's groups are the ones Megatron's
rule gives.

The groups come from the ledger's own derivation (ledger.evidence.layout) of the manifest's layout, never from the
engine: the manifest also records the groups each rank actually joined (`ranks[r].groups`, written by the engine),
and `groups_rows` holds the two against each other, so an engine that builds the wrong groups is "off". Every kind
the engine records is checked: the dense grid's eight (tp, cp, dp, dp_cp, pp, mp, embedding, position) and, for an
MoE model (the manifest's config names experts), the expert grid's ep, expt_dp and expt_mp (Megatron's second rank
generator, ledger.evidence.layout.expert_layout); a kind the layout has no group of (expert groups in a dense run) is
off.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

from ledger.evidence.layout import DEFAULT_ORDER, Layout, expert_group_lists, expert_layout, group_lists
from ledger.evidence.run import rank_entry
from ledger.reconcile.rows import Row, threshold_row

# The kinds a collective is attributed to, in the order a rank list several of them share resolves to. mp (TP x PP
# x CP) is the grad norm's group; last, since its ranks are another kind's whenever only one dimension is parallel.
KINDS = ("tp", "dp", "pp", "embedding", "mp")
EXPERT_KINDS = ("ep", "expt_dp", "expt_mp")


@lru_cache(maxsize=16)
def _lists(layout: Layout) -> dict[str, list[list[int]]]:
    return group_lists(layout)


def group_lists_of(manifest: dict[str, Any]) -> dict[str, list[list[int]]]:
    return _lists(Layout.from_manifest(manifest))


@lru_cache(maxsize=16)
def _expert_lists(world_size: int, tp: int, pp: int, ep: int, order: str) -> dict[str, list[list[int]]]:
    return expert_group_lists(expert_layout(world_size, tp=tp, pp=pp, ep=ep, order=order))


def expert_lists_of(manifest: dict[str, Any]) -> dict[str, list[list[int]]]:
    """An MoE run's expert groups (ep, expt_dp, expt_mp) on Megatron's expert grid; none for a dense run, for which
    the engine builds none."""
    config = manifest.get("config") or {}
    if (config.get("model") or {}).get("num_experts") is None:
        return {}
    par = config.get("parallel") or {}

    def size(key: str) -> int:
        return 1 if par.get(key) is None else int(par[key])

    return _expert_lists(int(manifest["world_size"]), size("tensor_model_parallel_size"),
                         size("pipeline_model_parallel_size"), size("expert_model_parallel_size"),
                         par.get("order") or DEFAULT_ORDER)


def rank_groups(manifest: dict[str, Any], rank: int) -> dict[str, tuple[int, ...]]:
    """This rank's TP, DP, PP and model-parallel groups, and its embedding group on the first and last pipeline stage,
    as sorted rank tuples (a middle stage is in no embedding group)."""
    lists = group_lists_of(manifest)
    return {kind: tuple(sorted(group)) for kind in KINDS for group in lists[kind] if rank in group}


def group_kind(groups: dict[str, tuple[int, ...]], ranks: tuple[int, ...] | None, op: str | None = None,
               issued_as: str | None = None) -> str:
    """"dp" / "tp" / "pp" / "embedding" / "mp" for a collective's rank list, "other" for any other group, "unknown"
    when no ranks are known. A rank list that is several kinds' goes to the one the evidence names (`issued_as`: the
    engine range the collective was issued in, ledger.evidence.trace_groups), else to the first in KINDS order,
    except that under PP2 the pipeline group is also the embedding group, whose only collective is the tied
    embedding's grad all-reduce: an all-reduce there is the embedding's unless the evidence says it was issued
    outside the embedding's range (`issued_as` ""); point-to-point, the loss broadcast and every other op are the
    pipeline's."""
    if ranks is None:
        return "unknown"
    key = tuple(sorted(ranks))
    kinds = [kind for kind in KINDS if groups.get(kind) == key]
    if issued_as in kinds:
        return issued_as
    if "pp" in kinds and "embedding" in kinds:
        kinds.remove("pp" if op == "all_reduce" and issued_as is None else "embedding")
    return kinds[0] if kinds else "other"


def rank_label(rank: int, coords: dict[str, int]) -> str:
    return f"rank {rank} (tp{coords.get('tp', 0)} dp{coords.get('dp', 0)} pp{coords.get('pp', 0)})"


def groups_rows(manifest: dict[str, Any]) -> list[Row]:
    """One row per rank whose manifest entry records its groups: the number of group kinds where the engine's group
    differs from Megatron's rule (0 expected; any difference is off and named)."""
    lists = {**group_lists_of(manifest), **expert_lists_of(manifest)}
    rows = []
    for rank in range(int(manifest["world_size"])):
        actual = rank_entry(manifest, rank).get("groups")
        if not isinstance(actual, dict):
            continue
        wrong = []
        for kind, ranks in sorted(actual.items()):
            expected = next((g for g in lists.get(kind, []) if rank in g), None)
            if kind not in lists:
                wrong.append(f"{kind} {list(ranks)} (no {kind} group in this layout"
                             + (": the config has no experts)" if kind in EXPERT_KINDS else ")"))
            elif list(ranks) != expected:
                wrong.append(f"{kind} {list(ranks)} (Megatron's rule: {expected})")
        missing = [kind for kind in ("tp", "dp", "pp", *(EXPERT_KINDS if "ep" in lists else ())) if kind not in actual]
        wrong += [f"{kind} not recorded" for kind in missing]
        rows.append(threshold_row(
            "topology.rank_groups", "rank", measured=len(wrong), warn_at=1, off_at=1, unit="count",
            explanation=("the engine's process groups for this rank differ from Megatron's rank rule: "
                         + "; ".join(wrong)) if wrong else
            f"the {len(actual)} process groups the engine created for this rank are Megatron's",
            rank=rank, source="manifest"))
    return rows
