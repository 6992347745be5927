"""The critical path of a replayed step: the chain of work, host or device, that made the step as long as it was.

Every point of the replay got its time from one predecessor (the binding edge: `Replay.binding`); walking those
back from the end of a step's window until before its start gives a chain of segments that tiles the replayed
step exactly: host time on a thread (named by the innermost op it was spent in), a GPU op on a stream, a launch
latency, a stream's queue gap, a cross-stream wait, a kernel held back by another stream's kernel, a sync's
wake-up, a wait for another thread, a collective's transfer after its last member arrived. Their sum is the
replayed step, by construction.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from ledger.evidence.exec_graph import ANNOTATION, GpuOp, HostOp
from ledger.evidence.replay import HOST, RUN, SYNC, THREAD, Replay


@dataclass(frozen=True, slots=True)
class PathSegment:
    rank: int
    kind: str  # the edge kind (ledger.evidence.replay): host, gpu, launch, stream order, sync, thread wait, ...
    where: str  # "thread 646", "stream 7"; "rank 1 stream 7" on another rank than the path's
    name: str  # the op the time went to ("" for a latency between ops)
    start: float  # µs, replayed clock
    end: float
    op: HostOp | GpuOp | None = None  # the host op the time went to (innermost), or the GPU op run

    @property
    def duration(self) -> float:
        return self.end - self.start


@dataclass
class CriticalPath:
    rank: int
    step: int
    segments: list[PathSegment]  # in time order, clipped to the step's replayed window

    @property
    def length(self) -> float:
        return sum(s.duration for s in self.segments)

    def by_kind(self) -> dict[str, float]:
        """µs of the path per edge kind, host threads and streams apart ("host on thread 646")."""
        out: dict[str, float] = defaultdict(float)
        for s in self.segments:
            out[f"{s.kind} on {s.where}" if s.kind in (HOST, RUN) else s.kind] += s.duration
        return dict(out)

    def top_ops(self, n: int = 5) -> list[tuple[str, float]]:
        """The ops that held the path longest, summed over their segments."""
        out: dict[str, float] = defaultdict(float)
        for s in self.segments:
            if s.name:
                out[f"{s.where}: {s.name}"] += s.duration
        return sorted(out.items(), key=lambda kv: -kv[1])[:n]


def critical_path(rp: Replay, rank: int, step: int) -> CriticalPath:
    """The binding chain from the end of `step`'s window on `rank` back to its start."""
    start_node, end_node = rp.step_nodes[(rank, step)]
    t0 = rp.times[start_node]
    segments: list[PathSegment] = []
    v = end_node
    while rp.times[v] > t0:
        u, kind = rp.binding[v]
        if u < 0:
            break
        segments.append(_segment(rp, u, v, kind, t0, rank))
        v = u
    segments.reverse()
    return CriticalPath(rank, step, [s for s in segments if s.duration > 0])


def _segment(rp: Replay, u: int, v: int, kind: str, t0: float, rank: int) -> PathSegment:
    """The edge u -> v as a segment: where it ran and what it is named after (the op the host time went to; the
    GPU op; the sync call; the op whose end woke the thread)."""
    item, before = rp.points[v].item, rp.points[u].item
    op: HostOp | GpuOp | None = None
    if isinstance(item, GpuOp):
        where = f"stream {item.stream}"
        name = (short_name(item.name) if item.kind == "kernel" else item.name) if kind == RUN else ""
        op = item if kind == RUN else None
    elif item is not None:
        where, name = f"thread {item.thread}", _host_name(rp.within[v], kind, before)
        op = rp.within[v] if kind == HOST else None
    else:
        where, name = "", ""
    on = rp.points[v].rank
    where = where if on == rank or not where else f"rank {on} {where}"
    return PathSegment(on, kind, where, name, max(rp.times[u], t0), rp.times[v], op)


def _host_name(inner: HostOp | None, kind: str, before: HostOp | GpuOp | None) -> str:
    if kind == THREAD and isinstance(before, HostOp):
        return f"woken by thread {before.thread} ({before.name} ended)"
    if kind == SYNC and inner is not None:
        return inner.name
    if kind != HOST:
        return ""
    if inner is None or inner.kind == ANNOTATION:
        return f"untraced time in {inner.name}" if inner is not None else "untraced time"
    return inner.name


def short_name(kernel: str) -> str:
    """A kernel's name without its template and argument lists: "void ns::k<4, F<float>>(int, F)" -> "ns::k"; a
    name Kineto left mangled (CUTLASS's, over a thousand characters) by its leading names, "_ZN7cutlass13device_
    kernelI..." -> "cutlass::device_kernel"."""
    if kernel.startswith("_Z"):
        return _mangled_prefix(kernel) or kernel
    text, depth, out = kernel.replace("(anonymous namespace)::", "").removeprefix("void "), 0, []
    for ch in text:
        depth += (ch == "<") - (ch == ">")
        if ch == "(" and depth == 0:
            break
        if depth == 0 and ch != ">":
            out.append(ch)
    return "".join(out).strip() or kernel


def _mangled_prefix(name: str) -> str:
    """The source names an Itanium-mangled name starts with (<length><identifier>, after _Z or _ZN), joined by
    "::", up to its first template argument list or anything else."""
    i, parts = 3 if name.startswith("_ZN") else 2, []
    while i < len(name) and name[i].isdigit():
        j = i
        while j < len(name) and name[j].isdigit():
            j += 1
        length = int(name[i:j])
        parts.append(name[j:j + length])
        i = j + length
    return "::".join(parts)
