"""Replay: the execution graphs of one or more ranks re-run from their measured durations, so that a step's length
comes out of what waited for what, not out of its own timestamps.

The graph becomes a DAG of time points (the start and end of every host op and GPU op; docs/formulas.md, "Replay"):
  * a host thread passes its points in order, each gap being the measured host time between them, except
    - a sync call, which returns `wake` after the GPU work it waits for is done (or after its own measured
      duration, if that work was already done when it was called);
    - a wait for another thread: a gap of at least MIN_WAIT_US on a thread doing nothing traced, in which an op
      of another thread ended at most MAX_WAKE_US before the thread resumed (the autograd thread finishing a
      backward, a gloo worker finishing a collective): the thread resumes as long after that end as it measurably
      did (that hand-off is host time, scheduled by the operating system: 20 µs to 1 ms on a busy 2-core host,
      so it is taken as measured, as the host time between ops is); a thread's first op follows the last thing
      another thread did before it, in the same way;
  * a GPU op starts at max(its launch call's start + `launch`, the end of the previous op on its stream + `queue`,
    the work its stream was made to wait for), and ends its measured duration later;
  * a collective kernel matched across the replayed ranks (NCCL: group ranks and sequence number; two ranks' P2P
    kernels without either, by their order) ends its measured transfer (end - last member's start) after its last
    member started.
The device-side latencies are each trace's medians (`Latencies`: launch, queue, wake), not each edge's own measured
value: a replay that reproduces a step does so because the graph does, and a change to any duration moves what
depends on it. (A CPU trace has no device side: its replay is all measured host time and hand-offs, so it
reproduces its steps exactly, and what it shows is how a change would propagate.)
"""
from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass
from statistics import median
from typing import Callable

from common.errors import InputError
from ledger.evidence.exec_graph import RUNTIME, ExecGraph, GpuOp, HostOp, Sync, ThreadTimeline, match_collectives

MIN_WAIT_US = 50.0  # a shorter idle gap is a thread's own overhead between ops
MAX_WAKE_US = 1000.0  # a thread resuming later than this after another's op ended was not woken by it
MIN_LATE_US = 20.0  # a kernel starting this much later than its stream and launch allow waited for something else
MAX_HANDOFF_US = 50.0  # ... for the SMs of another stream's kernel that ended this close to its start
HOST, RUN, LAUNCH, STREAM, EVENT, SYNC, THREAD, PEER, ORIGIN, SMS = (
    "host", "gpu", "launch", "stream order", "stream wait", "sync", "thread wait", "peer", "origin",
    "another stream's SMs")


@dataclass(frozen=True)
class Latencies:
    """A trace's typical device-side latencies (µs, medians): a launch call's start to its op's start on an idle
    stream; the gap between back-to-back ops on a busy stream; the awaited work's end to a blocking sync's return."""
    launch: float
    queue: float
    wake: float


@dataclass(frozen=True, slots=True)
class Point:
    """A node of the replay: the start or end of one host op or GPU op of one rank (None: the common origin)."""
    rank: int
    item: HostOp | GpuOp | None
    end: bool


@dataclass(frozen=True, slots=True)
class StepReplay:
    rank: int
    step: int
    measured: float  # µs, the ProfilerStep#N window
    replayed: float

    @property
    def error(self) -> float:
        """(replayed - measured) / measured."""
        return (self.replayed - self.measured) / self.measured


@dataclass
class Replay:
    points: list[Point]
    measured: list[float]
    times: list[float]  # replayed
    binding: list[tuple[int, str]]  # per node, the predecessor (and edge kind) that set its time; -1 for the origin
    within: list[HostOp | None]  # per host point, the innermost op open since the thread's previous point
    steps: list[StepReplay]
    latencies: dict[int, Latencies]  # by rank
    step_nodes: dict[tuple[int, int], tuple[int, int]]  # (rank, step) -> its window's start and end nodes


def measure_latencies(graph: ExecGraph) -> Latencies:
    """The medians of `Latencies` over one trace (0 where the trace shows no instance: a CPU trace)."""
    launch, queue, wake = [], [], []
    for ops in graph.streams.values():
        for prev, op in zip([None, *ops], ops):
            if op.launch is None:
                continue
            if prev is None or prev.end <= op.launch.start:
                launch.append(op.start - op.launch.start)
            elif op.start - prev.end < op.start - op.launch.start:
                queue.append(op.start - prev.end)
    for s in graph.syncs:
        done = max((a.end for a in s.awaited), default=None)
        if done is not None and done > s.call.start:
            wake.append(max(0.0, s.call.end - done))
    return Latencies(*(median(xs) if xs else 0.0 for xs in (launch, queue, wake)))


class _Cycle(ValueError):
    """Some point waits, through the graph's edges, on itself: the trace's events contradict their order."""


class _Dag:
    def __init__(self, origin: float):
        self.points: list[Point] = [Point(-1, None, False)]
        self.measured: list[float] = [origin]
        self.preds: list[list[tuple[int, float, str]]] = [[]]
        self.within: list[HostOp | None] = [None]  # host points: the innermost op open from the previous point

    def node(self, point: Point, t: float) -> int:
        self.points.append(point)
        self.measured.append(t)
        self.preds.append([])
        self.within.append(None)
        return len(self.points) - 1

    def edge(self, u: int, v: int, weight: float, kind: str) -> None:
        self.preds[v].append((u, weight, kind))

    def longest(self) -> tuple[list[float], list[tuple[int, str]]]:
        """Each node's earliest time given its predecessors (Kahn's order), and which predecessor bound it."""
        n = len(self.points)
        succ: list[list[int]] = [[] for _ in range(n)]
        waiting = [len(p) for p in self.preds]
        for v, preds in enumerate(self.preds):
            for u, _, _ in preds:
                succ[u].append(v)
        times, binding = [0.0] * n, [(-1, ORIGIN)] * n
        times[0] = self.measured[0]
        ready = deque(v for v in range(n) if waiting[v] == 0)
        done = 0
        while ready:
            v = ready.popleft()
            done += 1
            for u, w, kind in self.preds[v]:
                if times[u] + w > times[v] or binding[v][0] < 0:
                    times[v], binding[v] = times[u] + w, (u, kind)
            for s in succ[v]:
                waiting[s] -= 1
                if waiting[s] == 0:
                    ready.append(s)
        if done != n:
            raise _Cycle(f"{n - done} of {n} points wait on each other")
        return times, binding


def replay(graphs: list[ExecGraph], gpu_duration: Callable[[GpuOp], float] | None = None,
           host_factor: Callable[[HostOp | None], float] | None = None) -> Replay:
    """Replay the ranks' graphs together (one clock: the ranks' traces must share it, as traces of one host do).
    `gpu_duration` (a GPU op's duration) and `host_factor` (what multiplies host time spent with this op innermost)
    change the inputs: a what-if, and the tests' check that the replay follows its inputs."""
    duration = gpu_duration or _measured
    starts = [op.start for g in graphs for t in g.threads for op in t.ops[:1]]
    dag = _Dag(min(starts + [op.start for g in graphs for op in g.gpu_ops()]))
    lats: dict[int, Latencies] = {}
    steps: dict[tuple[int, int], tuple[int, int]] = {}
    collectives: list[tuple[int, GpuOp, int, int]] = []
    for i, g in enumerate(graphs):
        rank = g.rank if g.rank is not None else i
        lats[rank] = lat = measure_latencies(g)
        gpu = _add_gpu(dag, rank, g, lat, duration)
        _add_occupancy(dag, g, lat, gpu)
        host = _add_host(dag, rank, g, lat, host_factor or _unchanged, gpu)
        _add_launches(dag, g, lat, host, gpu)
        collectives += [(rank, op, *gpu[id(op)]) for op in g.gpu_ops() if op.collective is not None]
        steps.update({(rank, n): host[id(op)] for n, op in g.steps.items()})
    _add_peers(dag, collectives, duration)
    try:
        times, binding = dag.longest()
    except _Cycle as exc:
        raise InputError(", ".join(sorted({str(g.path) for g in graphs})),
                         f"events out of order, the execution graph cannot be replayed ({exc}): "
                         "a launch after its kernel, or a wait before what it waits for") from None
    out = [StepReplay(rank, n, dag.measured[e] - dag.measured[s], times[e] - times[s])
           for (rank, n), (s, e) in sorted(steps.items())]
    return Replay(dag.points, dag.measured, times, binding, dag.within, out, lats, steps)


def _measured(op: GpuOp) -> float:
    return op.end - op.start


def _unchanged(op: HostOp | None) -> float:
    return 1.0


def _add_gpu(dag: _Dag, rank: int, g: ExecGraph, lat: Latencies,
             duration: Callable[[GpuOp], float]) -> dict[int, tuple[int, int]]:
    """Every GPU op's start and end, in stream order; returns id(op) -> (start node, end node)."""
    nodes: dict[int, tuple[int, int]] = {}
    for ops in g.streams.values():
        prev_end = None
        for op in ops:
            s, e = dag.node(Point(rank, op, False), op.start), dag.node(Point(rank, op, True), op.end)
            nodes[id(op)] = (s, e)
            dag.edge(s, e, duration(op), RUN)
            if prev_end is not None:
                dag.edge(prev_end, s, lat.queue, STREAM)
            if op.launch is None:
                dag.edge(0, s, op.start - dag.measured[0], ORIGIN)
            prev_end = e
    return nodes


def _add_occupancy(dag: _Dag, g: ExecGraph, lat: Latencies, gpu: dict[int, tuple[int, int]]) -> None:
    """A kernel that started later than its stream order and its launch allow, as a kernel of another stream ended,
    waited for that kernel's SMs (a wide elementwise kernel fills the GPU: Megatron-LM's DDP adds into main_grad on
    a second stream hold back the compute stream's kernels): it starts as long after that end as it measurably did
    (at that end where it began while the other's last blocks drained).
    NCCL's kernels hold few SMs, copies and memsets none: nothing waits for them here."""
    holders = sorted((op for op in g.gpu_ops() if op.kind == "kernel" and op.collective is None),
                     key=lambda op: op.end)
    ends = [op.end for op in holders]
    for ops in g.streams.values():
        for prev, op in zip([None, *ops], ops):
            bounds = ([prev.end + lat.queue] if prev else []) + ([op.launch.start + lat.launch] if op.launch else [])
            ready = max(bounds, default=op.start)
            if op.kind != "kernel" or op.start - ready < MIN_LATE_US:
                continue
            i = bisect_left(ends, op.start + MAX_HANDOFF_US) - 1
            while i >= 0 and ends[i] >= op.start - MAX_HANDOFF_US:
                if holders[i].stream != op.stream and holders[i].start < op.start:
                    dag.edge(gpu[id(holders[i])][1], gpu[id(op)][0], max(0.0, op.start - holders[i].end), SMS)
                    break
                i -= 1


def _add_launches(dag: _Dag, g: ExecGraph, lat: Latencies, host: dict[int, tuple[int, int]],
                  gpu: dict[int, tuple[int, int]]) -> None:
    """A launch call's start -> its op's start; a stream wait's awaited op -> the first op its stream got after it."""
    for op in g.gpu_ops():
        if op.launch is not None:
            dag.edge(host[id(op.launch)][0], gpu[id(op)][0], lat.launch, LAUNCH)
    for w in g.waits:
        after = [op for op in g.streams[w.stream] if op.enqueued >= w.call.start]
        if after:
            dag.edge(gpu[id(w.awaited)][1], gpu[id(min(after, key=lambda o: o.enqueued))][0], lat.queue, EVENT)


def _add_peers(dag: _Dag, collectives: list[tuple[int, GpuOp, int, int]],
               duration: Callable[[GpuOp], float]) -> None:
    """Collective kernels matched across ranks: each ends its transfer after the last member's start, the transfer
    being what its measured duration holds after that start (scaled as `duration` scales the whole)."""
    for members in match_collectives([(rank, op.collective, op.start, op.end, (op, s, e))
                                      for rank, op, s, e in collectives]):
        last = max(op.start for op, _, _ in members)
        for op, _, e in members:
            transfer = (op.end - last) * (duration(op) / _measured(op) if _measured(op) > 0 else 1.0)
            dag.preds[e] = [p for p in dag.preds[e] if p[2] != RUN]
            for _, s, _ in members:
                dag.edge(s, e, transfer, PEER)


def _walk(t: ThreadTimeline) -> list[tuple[float, HostOp, bool]]:
    """A thread's op starts and ends in the order it passed them (its ops are properly nested)."""
    out: list[tuple[float, HostOp, bool]] = []
    open_ops: list[HostOp] = []
    for op in t.ops:
        while open_ops and open_ops[-1].end <= op.start:
            done = open_ops.pop()
            out.append((done.end, done, True))
        out.append((op.start, op, False))
        open_ops.append(op)
    out += [(op.end, op, True) for op in reversed(open_ops)]
    return out


def _add_host(dag: _Dag, rank: int, g: ExecGraph, lat: Latencies, factor: Callable[[HostOp | None], float],
              gpu: dict[int, tuple[int, int]]) -> dict[int, tuple[int, int]]:
    """Every host thread's chain of points; returns id(op) -> (start node, end node)."""
    nodes: dict[int, list[int]] = {}
    chains = []
    for t in g.threads:
        walk = _walk(t)
        ids = [dag.node(Point(rank, op, is_end), at) for at, op, is_end in walk]
        for (at, op, is_end), v in zip(walk, ids):
            nodes.setdefault(id(op), [0, 0])[is_end] = v
        chains.append((t, walk, ids))
    wakers = _Wakers(chains)
    syncs = {id(s.call): s for s in g.syncs}
    for t, walk, ids in chains:
        _add_chain(dag, walk, ids, wakers if _runs_cpu_ops(t) else None, syncs, lat, factor, gpu)
    return {k: (v[0], v[1]) for k, v in nodes.items()}


def _add_chain(dag: _Dag, walk: list[tuple[float, HostOp, bool]], ids: list[int], wakers: _Wakers | None,
               syncs: dict[int, Sync], lat: Latencies, factor: Callable[[HostOp | None], float],
               gpu: dict[int, tuple[int, int]]) -> None:
    """One thread's edges: host time between consecutive points, a sync's return after its awaited work, a wait's
    return after the op of another thread that woke it (`wakers`: None for a thread that only makes runtime
    calls, which waits for no thread here). Its first point is woken from the origin the same way."""
    thread = walk[0][1].thread
    waker = wakers.first(thread, walk[0][0]) if wakers else None
    dag.edge(0, ids[0], 0.0 if waker else walk[0][0] - dag.measured[0], ORIGIN)
    if waker:
        dag.edge(waker[1], ids[0], walk[0][0] - waker[0], THREAD)
    open_ops: list[HostOp] = []
    for k in range(1, len(walk)):
        (t0, op0, end0), t1 = walk[k - 1], walk[k][0]
        if end0:
            open_ops.pop()
        else:
            open_ops.append(op0)
        inner = dag.within[ids[k]] = open_ops[-1] if open_ops else None
        sync = syncs.get(id(op0)) if not end0 else None
        waker = wakers.find(thread, t0, t1) if wakers and (inner is None or inner.kind != RUNTIME) else None
        if sync is not None and sync.awaited:
            blocked = max(a.end for a in sync.awaited) > sync.call.start
            dag.edge(ids[k - 1], ids[k], 0.0 if blocked else (t1 - t0) * factor(inner), HOST)
            for a in sync.awaited:
                dag.edge(gpu[id(a)][1], ids[k], lat.wake, SYNC)
        elif waker is not None:
            dag.edge(ids[k - 1], ids[k], 0.0, HOST)
            dag.edge(waker[1], ids[k], (t1 - waker[0]) * factor(inner), THREAD)
        else:
            dag.edge(ids[k - 1], ids[k], (t1 - t0) * factor(inner), HOST)


def _runs_cpu_ops(t: ThreadTimeline) -> bool:
    return any(op.kind != RUNTIME for op in t.ops)


class _Wakers:
    """The op starts and ends of the threads that run CPU ops, searchable by time. Threads that only make runtime
    calls (NCCL's watchdog, event pollers) neither wake another thread nor wait for one here."""

    def __init__(self, chains: list[tuple[ThreadTimeline, list[tuple[float, HostOp, bool]], list[int]]]):
        points = sorted(((at, t.thread, v, is_end) for t, walk, ids in chains if _runs_cpu_ops(t)
                         for (at, _, is_end), v in zip(walk, ids)), key=lambda p: p[0])
        self.points, self.times = points, [p[0] for p in points]

    def find(self, thread: object, t0: float, t1: float) -> tuple[float, int] | None:
        """For a gap (t0, t1) of `thread` of at least MIN_WAIT_US: the last op end of another thread in it, if the
        thread resumed within MAX_WAKE_US of it (what the thread was waiting for), as (time, node). Strictly before
        t1, as in `first`: a hand-off takes time, and two threads cannot each be the other's waker."""
        if t1 - t0 < MIN_WAIT_US:
            return None
        i = bisect_left(self.times, t1) - 1
        while i >= 0 and self.times[i] > max(t0, t1 - MAX_WAKE_US):
            at, other, v, is_end = self.points[i]
            if is_end and other != thread:
                return at, v
            i -= 1
        return None

    def first(self, thread: object, t: float) -> tuple[float, int] | None:
        """For a thread's first point at `t`: the last thing another thread did before it (an op's start or end),
        which started it: a thread's first op follows the rest of the process, not the trace's origin."""
        i = bisect_left(self.times, t) - 1
        while i >= 0 and self.points[i][1] == thread:
            i -= 1
        return (self.times[i], self.points[i][2]) if i >= 0 else None
