"""One rank's execution graph, read from its Kineto (torch.profiler Chrome) trace: what ran where, and what waited
for what.

What the graph holds (docs/formulas.md, "Execution graph" says how each link is inferred and checked):
  * host threads: their CPU ops, annotations, Python functions and CUDA runtime/driver calls, in order, with nesting;
  * streams: the GPU work (kernels, copies, memsets) each ran, in order, each linked to the runtime call that
    enqueued it by args "correlation" (or, for a record without it, by its "ac2g" flow);
  * cross-stream waits: a cudaStreamWaitEvent makes a stream wait for what another stream had enqueued when the
    event was recorded. Kineto records neither the event nor the streams of these calls, so they are inferred
    from the issuing thread: the waiting stream is the one its next launch goes to, the event the last one it
    recorded, recorded on the stream its launch before that record went to;
  * host synchronisations: stream / event / device syncs and blocking copies, each with the GPU work it waited
    for (inferred the same way), and the value reads (aten::item, aten::_local_scalar_dense) that contain them;
  * NCCL kernels with the collective they run (group ranks, sequence number), to be matched across ranks.
The reader streams the trace's typed records (ledger.evidence.trace_events); what it keeps is what these links need.
"""
from __future__ import annotations

import gc
from bisect import bisect_left
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, TypeVar

from common.errors import InputError
from ledger.evidence.trace_events import NO_ARGS, TraceEvent
from ledger.evidence.trace_stream import TraceStream
from ledger.evidence.traces import STEP_RE, as_int, distributed_info, group_ranks, normalize_op

CPU_OP, ANNOTATION, PYTHON, RUNTIME = "cpu_op", "user_annotation", "python_function", "runtime"
HOST_CATEGORIES = {"cpu_op": CPU_OP, "user_annotation": ANNOTATION, "python_function": PYTHON,
                   "cuda_runtime": RUNTIME, "cuda_driver": RUNTIME}
GPU_CATEGORIES = {"kernel": "kernel", "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
SYNC_CALLS = {"cudaStreamSynchronize": "stream", "cuStreamSynchronize": "stream", "cudaDeviceSynchronize": "device",
              "cuCtxSynchronize": "device", "cudaEventSynchronize": "event", "cuEventSynchronize": "event"}
EVENT_RECORDS = ("cudaEventRecord", "cudaEventRecordWithFlags", "cuEventRecord", "cuEventRecordWithFlags")
STREAM_WAITS = ("cudaStreamWaitEvent", "cuStreamWaitEvent")
READS = ("aten::item", "aten::_local_scalar_dense")
# Host ranges that wait for the next batch: the engine's data-wait probe range, torch's DataLoader iteration.
DATA_WAIT_PREFIXES = ("wait data", "enumerate(DataLoader)#")
P2P_COLLECTIVES = ("send", "recv", "send_recv")
GLOO_PREFIX = "gloo:"  # a gloo collective's range
T = TypeVar("T")


@dataclass(slots=True)
class HostOp:
    name: str
    kind: str  # CPU_OP | ANNOTATION | PYTHON | RUNTIME
    thread: Any
    start: float  # µs, the trace's clock
    end: float
    depth: int = 0  # nesting on its thread, 0 outermost
    correlation: int | None = None  # runtime calls: CUPTI's id, shared with the GPU work they enqueue


@dataclass(frozen=True, slots=True)
class CollectiveId:
    """What matches one NCCL kernel with its peers': the collective, its group's ranks and its sequence number
    (None where the trace does not record them: a P2P kernel carries neither)."""
    op: str
    group: tuple[int, ...] | None
    seq: int | None

    @property
    def p2p(self) -> bool:
        return self.op in P2P_COLLECTIVES


@dataclass(slots=True)
class GpuOp:
    name: str
    kind: str  # "kernel" | "memcpy" | "memset"
    stream: int
    start: float
    end: float
    correlation: int | None
    launch: HostOp | None = None  # the runtime call that enqueued it; None when it is not in the trace
    collective: CollectiveId | None = None

    @property
    def enqueued(self) -> float:
        """When the host put it on its stream (its start when the launch is not in the trace)."""
        return self.launch.start if self.launch is not None else self.start


@dataclass(slots=True)
class Sync:
    """A host call that blocks until GPU work is done: a stream, event or device sync, or a blocking copy."""
    call: HostOp
    kind: str  # "stream" | "event" | "device" | "copy"
    awaited: list[GpuOp]  # what it waits for; empty when nothing was in flight


@dataclass(slots=True)
class StreamWait:
    """cudaStreamWaitEvent: work enqueued on `stream` after `call` starts only once `awaited` is done."""
    call: HostOp
    stream: int
    awaited: GpuOp


@dataclass(slots=True)
class ThreadTimeline:
    thread: Any
    ops: list[HostOp]  # by start, an enclosing op before what it encloses

    @property
    def comm_worker(self) -> bool:
        """A gloo process group's worker thread: everything it runs is inside a gloo collective's range. (gloo's
        point-to-point ranges run on the thread that called them, beside its compute.)"""
        return bool(self.ops) and all(op.name.startswith(GLOO_PREFIX) for op in self.ops if op.depth == 0)


@dataclass
class ExecGraph:
    path: Path
    rank: int | None
    world_size: int | None
    threads: list[ThreadTimeline]
    streams: dict[int, list[GpuOp]]  # stream id -> its work in stream order
    syncs: list[Sync]
    waits: list[StreamWait]
    steps: dict[int, HostOp]  # ProfilerStep#N annotations (the measured step windows)
    reads: list[HostOp] = field(default_factory=list)  # aten::item / _local_scalar_dense
    data_waits: list[HostOp] = field(default_factory=list)
    unlinked: int = 0  # GPU work whose launch is not in the trace (enqueued before it began)

    @property
    def on_gpu(self) -> bool:
        return bool(self.streams)

    def gpu_ops(self) -> Iterator[GpuOp]:
        for ops in self.streams.values():
            yield from ops


@contextmanager
def cyclic_gc_paused() -> Iterator[None]:
    """Build and walk execution graphs with Python's cycle collector paused. A full trace makes millions of small
    objects (ops, replay points, edges) and none of them form cycles, but each full collection rescans all made so far:
    on one 270k-event H200 trace, reading, replaying and walking its graph took 7.0 s with it and 3.4 s without."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def read_graph(path: str | Path) -> ExecGraph:
    """The execution graph of one trace file (an InputError names a file that is not a readable Chrome trace)."""
    stream = TraceStream(path, TraceEvent)
    host: dict[Any, list[HostOp]] = {}
    gpu: list[GpuOp] = []
    flows: dict[tuple[str, Any, float], int] = {}  # ac2g flow ends by (phase, thread, ts) -> correlation
    for e in stream:
        ph, cat = e.ph, e.cat
        if ph in ("s", "f") and cat == "ac2g":
            flows[(ph, e.tid, e.ts or 0.0)] = as_int(e.id)
        elif ph != "X" or e.ts is None:
            continue
        elif cat in HOST_CATEGORIES:
            host.setdefault(e.tid, []).append(_host_op(e, HOST_CATEGORIES[cat]))
        elif cat in GPU_CATEGORIES:
            gpu.append(_gpu_op(e, GPU_CATEGORIES[cat]))
    info = distributed_info(stream.meta)
    threads = [ThreadTimeline(tid, _nested(ops)) for tid, ops in host.items()]
    unlinked = _link(threads, gpu, flows)
    streams: dict[int, list[GpuOp]] = {}
    for op in sorted(gpu, key=lambda o: (o.start, o.end)):
        streams.setdefault(op.stream, []).append(op)
    graph = ExecGraph(path=Path(path), rank=as_int(info.get("rank")), world_size=as_int(info.get("world_size")),
                      threads=threads, streams=streams, syncs=[], waits=[], steps={}, unlinked=unlinked)
    _classify(graph)
    return graph


def _host_op(e: TraceEvent, kind: str) -> HostOp:
    start = e.ts or 0.0
    corr = as_int(e.args.correlation) if kind == RUNTIME and e.args is not None else None
    return HostOp(name=e.name, kind=kind, thread=e.tid, start=start, end=start + e.dur, correlation=corr)


def _gpu_op(e: TraceEvent, kind: str) -> GpuOp:
    args = e.args or NO_ARGS
    start, name = e.ts or 0.0, e.name
    stream = as_int(args.stream)
    op = GpuOp(name=name, kind=kind, stream=stream if stream is not None else as_int(e.tid) or 0, start=start,
               end=start + e.dur, correlation=as_int(args.correlation))
    if kind == "kernel" and name.lower().startswith("nccl"):
        coll = normalize_op(str(args.collective_name or "")) or normalize_op(name) or "unknown"
        op.collective = CollectiveId(op=coll, group=group_ranks(args.group_ranks), seq=as_int(args.seq))
    return op


def _nested(ops: list[HostOp]) -> list[HostOp]:
    """A thread's ops by start, enclosing before enclosed, each with its depth. An op that starts inside another
    but ends after it (a µs of rounding) is cut to end with it: a thread runs one call at a time."""
    ops.sort(key=lambda o: (o.start, -o.end))
    open_ops: list[HostOp] = []
    for op in ops:
        while open_ops and open_ops[-1].end <= op.start:
            open_ops.pop()
        if open_ops:
            op.end = min(op.end, open_ops[-1].end)
        op.depth = len(open_ops)
        open_ops.append(op)
    return ops


def _link(threads: list[ThreadTimeline], gpu: list[GpuOp], flows: dict[tuple[str, Any, float], int]) -> int:
    """Each GPU op's launch: the runtime call with its correlation id, read from args or, failing that, from the
    ac2g flow that starts at the call and ends at the GPU op. Returns how many GPU ops stay unlinked."""
    calls: dict[int, HostOp] = {}
    for t in threads:
        for op in t.ops:
            if op.kind == RUNTIME:
                if op.correlation is None:
                    op.correlation = flows.get(("s", op.thread, op.start))
                if op.correlation is not None:
                    calls[op.correlation] = op
    unlinked = 0
    for g in gpu:
        if g.correlation is None:
            g.correlation = flows.get(("f", g.stream, g.start))
        g.launch = calls.get(g.correlation) if g.correlation is not None else None
        unlinked += g.launch is None
    return unlinked


class _Enqueued:
    """Per stream, its work in enqueue order, and per thread its launches: "the last op on stream S enqueued
    before t" and "the stream of this thread's last launch before t" by binary search."""

    def __init__(self, graph: ExecGraph):
        self.by_stream = {s: sorted(ops, key=lambda o: o.enqueued) for s, ops in graph.streams.items()}
        self.times = {s: [o.enqueued for o in ops] for s, ops in self.by_stream.items()}
        launches: dict[Any, list[GpuOp]] = {}
        for op in graph.gpu_ops():
            if op.launch is not None:
                launches.setdefault(op.launch.thread, []).append(op)
        self.launches = {t: sorted(ops, key=lambda o: o.enqueued) for t, ops in launches.items()}
        self.launch_times = {t: [o.enqueued for o in ops] for t, ops in self.launches.items()}

    def last_on(self, stream: int, t: float) -> GpuOp | None:
        i = bisect_left(self.times.get(stream, []), t)
        return self.by_stream[stream][i - 1] if i else None

    def stream_before(self, thread: Any, t: float) -> int | None:
        i = bisect_left(self.launch_times.get(thread, []), t)
        return self.launches[thread][i - 1].stream if i else None

    def stream_after(self, thread: Any, t: float) -> int | None:
        i = bisect_left(self.launch_times.get(thread, []), t)
        ops = self.launches.get(thread, [])
        return ops[i].stream if i < len(ops) else None


def _classify(graph: ExecGraph) -> None:
    """Fill the graph's steps, syncs, stream waits, value reads and data-wait ranges."""
    enq = _Enqueued(graph)
    copies = {op.launch.correlation: op for op in graph.gpu_ops() if op.kind == "memcpy" and op.launch is not None}
    for t in graph.threads:
        last_record: HostOp | None = None
        for op in t.ops:
            if op.kind == ANNOTATION and (m := STEP_RE.match(op.name)):
                if not op.end > op.start:
                    raise InputError(graph.path, f"{op.name} at {op.start} µs lasts {op.end - op.start} µs: a step "
                                     "window must have a duration")
                graph.steps[int(m.group(1))] = op
            elif op.kind == ANNOTATION and op.name.startswith(DATA_WAIT_PREFIXES):
                graph.data_waits.append(op)
            elif op.kind == CPU_OP and op.name in READS:
                graph.reads.append(op)
            elif op.kind != RUNTIME:
                continue
            elif op.name.startswith(EVENT_RECORDS):
                last_record = op
            elif op.name in SYNC_CALLS:
                graph.syncs.append(Sync(op, SYNC_CALLS[op.name], _awaited(enq, op, SYNC_CALLS[op.name],
                                                                          last_record)))
            elif op.name in STREAM_WAITS and last_record is not None:
                wait = _stream_wait(enq, op, last_record)
                if wait is not None:
                    graph.waits.append(wait)
            elif op.correlation in copies and _blocking_copy(op, copies[op.correlation]):
                graph.syncs.append(Sync(op, "copy", [copies[op.correlation]]))
    graph.syncs.sort(key=lambda s: s.call.start)


def _awaited(enq: _Enqueued, call: HostOp, kind: str, record: HostOp | None) -> list[GpuOp]:
    """What a sync waits for: every stream's last enqueued op (device), else the last op enqueued on the stream
    of the thread's last launch before the call (stream) or before the event's record (event). A sync returns only
    once what it waits for has ended, so an op that ended after the call returned was not it: an event recorded on
    another thread (the trace names no event), such as the grouped experts' counts copied in the forward and waited
    for by the autograd thread's backward. Without the record the wait is the call's measured time."""
    if kind == "device":
        ops = [op for s in enq.by_stream if (op := enq.last_on(s, call.start)) is not None]
    else:
        at = record.start if kind == "event" and record is not None else call.start
        stream = enq.stream_before(call.thread, at)
        found = enq.last_on(stream, at) if stream is not None else None
        ops = [found] if found is not None else []
    return [op for op in ops if op.end <= call.end]


def _stream_wait(enq: _Enqueued, call: HostOp, record: HostOp) -> StreamWait | None:
    """The wait's stream is where this thread launches next; it waits for the work enqueued on the recording stream
    before the record. None when that is the waiting stream itself (stream order already holds it) or unknown."""
    waiting, recorded = enq.stream_after(call.thread, call.end), enq.stream_before(record.thread, record.start)
    if waiting is None or recorded is None or waiting == recorded:
        return None
    awaited = enq.last_on(recorded, record.start)
    return StreamWait(call, waiting, awaited) if awaited is not None else None


def _blocking_copy(call: HostOp, copy: GpuOp) -> bool:
    """A copy the host waits for: cudaMemcpy (not Async), or a device-to-host copy into pageable memory."""
    synchronous_call = "Memcpy" in call.name and not call.name.endswith("Async")
    return synchronous_call or ("DtoH" in copy.name and "Pageable" in copy.name)


def match_collectives(items: list[tuple[int, CollectiveId, float, float, T]]) -> list[list[T]]:
    """Sets of one collective per member rank that ran together, from (rank, id, start, end, payload) of every
    traced rank: NCCL kernels by (op, group ranks, sequence number) when every member of the group is among them;
    P2P kernels without a group or sequence number, when exactly two ranks are given, the k-th of one rank with the
    k-th of the other (each pipeline transfer is one kernel on both sides, in the same order). A set whose members
    did not all run at once (one ended before another started) is no transfer between them and is dropped; so is
    anything else: unmatched."""
    keyed: dict[tuple[str, tuple[int, ...], int], list[tuple[int, float, float, T]]] = {}
    p2p: dict[int, list[tuple[int, float, float, T]]] = {}
    for rank, cid, start, end, payload in items:
        if cid.group is not None and cid.seq is not None:
            keyed.setdefault((cid.op, cid.group, cid.seq), []).append((rank, start, end, payload))
        elif cid.p2p:
            p2p.setdefault(rank, []).append((rank, start, end, payload))
    sets = [members for (_, group, _), members in keyed.items()
            if len(group) > 1 and sorted(r for r, *_ in members) == sorted(group)]
    if len(p2p) == 2:
        a, b = (sorted(ops, key=lambda x: x[1]) for ops in p2p.values())
        if len(a) == len(b):
            sets += [[x, y] for x, y in zip(a, b)]
    return [[p for *_, p in m] for m in sets if max(start for _, start, _, _ in m) <= min(end for _, _, end, _ in m)]
