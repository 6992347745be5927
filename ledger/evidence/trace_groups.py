"""The group ranks of traced collectives whose trace does not record them: gloo's annotations name no process group.

NCCL kernels carry "Process Group Ranks"; a gloo collective carries the worker thread it ran on and, through the
c10d op that issued it (ledger.evidence.traces), the innermost annotation around that op on the issuing thread. From
those, in this order, each collective without ranks gets the ranks of one of this rank's groups (`groups`, the ledger's
own derivation from the manifest) and the group kind the evidence names (`issued_as`, which ledger.reconcile.topology.
group_kind prefers where one rank set is two groups, the PP2 pipeline and embedding groups):
  1. issuing range: it was issued inside one of the engine's ranges whose category names a group (the rank's timing
     records give each range name its category: tp-comm, pp-comm, embd-comm, dp-comm, mp-comm, and dp-wait, the
     DDP pre-hook that issues the next bucket's all-gather while it waits for its own). The engine issues every
     collective inside such a range (an async one through probes.comm_issue), so on a run it records with timers
     this rule names them all, whichever worker thread ran them; the rules below serve traces recorded before, and
     rule 2's answer depends on which of a group's threads happened to run what;
  2. worker thread: a ProcessGroupGloo runs its work on threads of its own, so a thread that ran a collective named by
     rule 1 ran only that group's collectives (a thread named twice, differently, names nothing);
  3. only group of several ranks: when exactly one parallel dimension is larger than one, every group of more than
     one rank that this rank is in holds the whole world, so a collective named by nothing else ran on it. A
     collective on a group of one (the grad norm's model-parallel group under DP alone) is put there too: gloo
     records nothing that tells it apart, and it moves nothing.
Anything else stays without ranks ("none": group kind "unknown"), never guessed between two groups. Point-to-point
operations are left as they are: they are the pipeline's (ledger.reconcile.overlap.kernel_group) and their volume is
counted from the dispatcher's ops.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, replace
from typing import Any, Iterable

from common.events import COMM_CATEGORY_GROUP
from ledger.evidence.traces import P2P_KINDS, Collective, TraceSummary

RANGE_GROUPS = {**COMM_CATEGORY_GROUP, "dp-wait": "dp"}
RULES = RECORDED, P2P, RANGE, THREAD, ONLY_GROUP, NONE = ("recorded", "point-to-point", "issuing range",
                                                         "worker thread", "only group of several ranks", "none")


@dataclass
class GroupAttribution:
    summary: TraceSummary  # its collectives with the ranks and group kind the evidence names
    named_by: dict[str, int]  # how many collectives each rule named (RECORDED for ranks the trace holds)


def range_kinds(timing: Iterable[dict[str, Any]]) -> dict[str, str]:
    """Range name -> the group kind its category names, from a rank's timing records."""
    return {str(t.name): RANGE_GROUPS[t.category] for t in timing
            if t.category in RANGE_GROUPS and t.name is not None}


def attribute_groups(summary: TraceSummary, groups: dict[str, tuple[int, ...]], world_size: int,
                     kinds: dict[str, str]) -> GroupAttribution:
    """The summary with every collective's group ranks that the rules of this module's docstring give."""
    named: Counter[str] = Counter()
    by_range = {id(c): kinds[c.issued_in] for c in summary.collectives
                if c.group is None and c.op not in P2P_KINDS and c.issued_in in kinds and kinds[c.issued_in] in groups}
    threads = _thread_kinds(summary.collectives, by_range)
    only = _only_group(groups, world_size)
    out = []
    for c in summary.collectives:
        rule, kind = _rule(c, by_range, threads, only)
        named[rule] += 1
        if kind is not None:
            c = replace(c, group=groups[kind], issued_as=kind)
        elif rule == ONLY_GROUP:
            c = replace(c, group=only, issued_as=None if c.issued_in is None else "")
        out.append(c)
    return GroupAttribution(replace(summary, collectives=out), dict(named))


def _rule(c: Collective, by_range: dict[int, str], threads: dict[Any, str],
          only: tuple[int, ...] | None) -> tuple[str, str | None]:
    if c.group is not None:
        return RECORDED, None
    if c.op in P2P_KINDS:
        return P2P, None
    if id(c) in by_range:
        return RANGE, by_range[id(c)]
    if c.thread in threads:
        return THREAD, threads[c.thread]
    return (ONLY_GROUP, None) if only is not None else (NONE, None)


def _thread_kinds(collectives: list[Collective], by_range: dict[int, str]) -> dict[Any, str]:
    seen: dict[Any, set[str]] = {}
    for c in collectives:
        if id(c) in by_range and c.thread is not None:
            seen.setdefault(c.thread, set()).add(by_range[id(c)])
    return {thread: kinds.pop() for thread, kinds in seen.items() if len(kinds) == 1}


def _only_group(groups: dict[str, tuple[int, ...]], world_size: int) -> tuple[int, ...] | None:
    several = {ranks for ranks in groups.values() if len(ranks) > 1}
    world = tuple(range(world_size))
    return world if several == {world} else None
