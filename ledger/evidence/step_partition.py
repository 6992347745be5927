"""A profiled step's window partitioned into named terms that add up to it: each instant goes to one term.

docs/formulas.md, "Step decomposition", defines it. In priority order, an instant of the step window is
  1. device compute: the device runs work that is not communication (a GPU kernel, copy or memset on any stream; on
     a CPU trace, a thread that is no gloo worker inside a CPU op, outside c10d calls, gloo ranges and stalls);
  2. exposed communication of a group: otherwise, a collective of that group moves data (after its last member
     arrived, or at any time when the peers were not traced);
  3. pipeline wait: otherwise, a point-to-point transfer waits for its peer stage to arrive;
  4. waiting for a slower rank: otherwise, a collective waits for the last member of its group to arrive;
  5. launch latency: otherwise (the device idle), GPU work whose launch call has returned has not started: the
     device getting to work it already holds (the gap between back-to-back kernels, a late launch's latency);
  6. data wait: otherwise, the host is inside a data-wait range;
  7. synchronisation: otherwise, a host thread is blocked in a sync call or reading a value (aten::item);
  8. host-bound idle: the rest: the device waits while the host works (launches, Python, untraced code).
Each term is the length of its instants, so the terms sum to the window (to float rounding) by construction.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable

from common.intervals import Interval, length, subtract, union
from ledger.evidence.exec_graph import CPU_OP, GLOO_PREFIX, CollectiveId, ExecGraph, match_collectives
from ledger.evidence.traces import STALL_PREFIX

COMPUTE, PIPELINE_WAIT, SLOWER_RANK = "device compute", "pipeline wait", "waiting for a slower rank"
LAUNCH, DATA_WAIT, SYNC, HOST_BOUND = "launch latency", "data wait", "synchronisation", "host-bound idle"
EXPOSED = "exposed communication"
# and EXPOSED per group, after COMPUTE
TERMS = (COMPUTE, PIPELINE_WAIT, SLOWER_RANK, LAUNCH, DATA_WAIT, SYNC, HOST_BOUND)
GROUP_ORDER = ("tp", "cp", "ep", "dp", "pp", "embedding", "other", "unknown")
NOT_COMPUTE = ("c10d::", GLOO_PREFIX, STALL_PREFIX)  # host ranges that communicate or wait


@dataclass(frozen=True, slots=True)
class CommSpan:
    """One collective (or P2P transfer) as it ran on this rank, with the group kind it served and when its last
    member arrived (None: its peers were not traced, so no instant of it can be called waiting)."""
    start: float
    end: float
    group: str
    p2p: bool
    ready: float | None = None


@dataclass(frozen=True)
class StepPartition:
    rank: int | None
    step: int
    start: float  # µs, the ProfilerStep#N window
    end: float
    terms: list[tuple[str, float]]  # (term, µs), in priority order; exposed communication per group

    @property
    def measured(self) -> float:
        return self.end - self.start

    @property
    def total(self) -> float:
        return sum(t for _, t in self.terms)


def partition_step(graph: ExecGraph, step: int, comm: list[CommSpan]) -> StepPartition:
    """`step`'s window on `graph`'s rank cut into the module's terms; `comm` are the rank's collectives."""
    window = graph.steps[step]
    rest: list[Interval] = [(window.start, window.end)]
    terms: list[tuple[str, float]] = []

    def take(term: str, spans: list[Interval]) -> None:
        nonlocal rest
        left = subtract(rest, union(spans))
        terms.append((term, length(rest) - length(left)))
        rest = left

    take(COMPUTE, device_compute(graph))
    groups = sorted({c.group for c in comm}, key=lambda g: (GROUP_ORDER.index(g) if g in GROUP_ORDER else 99, g))
    for group in groups:
        take(f"{EXPOSED} {group}", [(c.start if c.ready is None else max(c.start, c.ready), c.end)
                                    for c in comm if c.group == group])
    take(PIPELINE_WAIT, [(c.start, min(c.end, c.ready)) for c in comm if c.p2p and c.ready is not None])
    take(SLOWER_RANK, [(c.start, min(c.end, c.ready)) for c in comm if not c.p2p and c.ready is not None])
    take(LAUNCH, enqueued_idle(graph))
    take(DATA_WAIT, [(op.start, op.end) for op in graph.data_waits])
    take(SYNC, [(s.call.start, s.call.end) for s in graph.syncs] + [(op.start, op.end) for op in graph.reads])
    terms.append((HOST_BOUND, length(rest)))
    return StepPartition(graph.rank, step, window.start, window.end, terms)


def device_compute(graph: ExecGraph) -> list[Interval]:
    """When the device computes: GPU work other than NCCL kernels; on a CPU trace, the CPU ops of the threads that
    are no gloo worker, less what is communication or waiting in them: c10d calls, gloo ranges (point-to-point
    runs on the calling thread), the stall ranges ("wait ...") and data waits."""
    if graph.on_gpu:
        return union((op.start, op.end) for op in graph.gpu_ops() if op.collective is None)
    busy: list[Interval] = []
    for t in graph.threads:
        if t.comm_worker:
            continue
        ops = union((op.start, op.end) for op in t.ops if op.kind == CPU_OP)
        holes = union([(op.start, op.end) for op in t.ops if op.name.startswith(NOT_COMPUTE)]
                      + [(op.start, op.end) for op in graph.data_waits])
        busy += subtract(ops, holes)
    return union(busy)


def enqueued_idle(graph: ExecGraph) -> list[Interval]:
    """When some GPU work (not an NCCL kernel) was on its stream, its launch call returned, and had not started."""
    return [(op.launch.end, op.start) for op in graph.gpu_ops()
            if op.collective is None and op.launch is not None and op.launch.end < op.start]


def with_arrivals(items: list[tuple[int, CollectiveId, CommSpan]]) -> list[CommSpan]:
    """The (rank, collective, span) items' spans, each with its last member's arrival (the latest start) where
    ledger.evidence.exec_graph.match_collectives finds its members among the items."""
    spans = [span for _, _, span in items]
    for members in match_collectives([(rank, cid, s.start, s.end, i) for i, (rank, cid, s) in enumerate(items)]):
        ready = max(spans[i].start for i in members)
        for i in members:
            spans[i] = replace(spans[i], ready=ready)
    return spans


def nccl_spans(graph: ExecGraph, group_of: Callable[[CollectiveId], str]) -> list[tuple[int, CollectiveId, CommSpan]]:
    """A GPU trace's NCCL kernels as (rank, collective, span) items, each named by `group_of`."""
    rank = graph.rank if graph.rank is not None else 0
    return [(rank, op.collective, CommSpan(op.start, op.end, group_of(op.collective), op.collective.p2p))
            for op in graph.gpu_ops() if op.collective is not None]
