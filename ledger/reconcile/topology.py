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

from ledger.evidence.layout import expert_group_lists, expert_layout, group_lists
from ledger.evidence.run import RunEvidence
from ledger.reconcile.rows import Row, threshold_row

EXPERT_KINDS = ("ep", "expt_dp", "expt_mp")


def expert_lists(ev: RunEvidence) -> dict[str, list[list[int]]]:
    """An MoE run's expert groups (ep, expt_dp, expt_mp) on Megatron's expert grid; none for a dense run, for which
    the engine builds none."""
    cfg = ev.config
    if cfg is None or not cfg.model.is_moe:
        return {}
    p = cfg.parallel
    return expert_group_lists(expert_layout(ev.world_size, tp=p.tensor_model_parallel_size,
                                            pp=p.pipeline_model_parallel_size, ep=p.expert_model_parallel_size,
                                            order=p.order))


def groups_rows(ev: RunEvidence) -> list[Row]:
    """One row per rank whose manifest entry records its groups: the number of group kinds where the engine's group
    differs from Megatron's rule (0 expected; any difference is off and named). None without a config: there is no
    layout to derive the rule's groups from (evidence's `missing` says so)."""
    if ev.layout is None:
        return []
    lists = {**group_lists(ev.layout), **expert_lists(ev)}
    rows = []
    for rank in range(ev.world_size):
        info = ev.rank_infos.get(rank)
        actual = info.groups if info is not None else None
        if actual is None:
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
