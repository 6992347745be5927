"""Chrome traces from torch.profiler, read one file at a time and reduced to what the ledger needs.

Memory stays bounded by far less than one trace: events are decoded a batch at a time into records of the few
fields read here (ledger.evidence.trace_stream, ledger.evidence.trace_events), so a trace is summarised
(`summarize`) without ever holding the document. A trace is gzip or plain JSON; corrupt gzip, a truncated file or a
JSON document that is not a Chrome trace is an InputError naming the file.

What a summary keeps, per rank:
  * the ProfilerStep#N windows (CPU user annotations, and their GPU-side twins) -> step numbers;
  * collectives: NCCL kernels on GPU traces (args "Collective name", "In msg nelems", "Out msg nelems", "dtype",
    "Process Group Ranks"/"Group size", "Seq"), else gloo's "gloo:<op>" annotations on CPU traces. gloo's annotation
    records its process group's worker thread and its first input only, and calls a reduce-scatter "gloo:all_reduce"
    (gloo runs it as one); so each is read through the dispatcher's `c10d::<op>` that issued it (`_link_gloo`): the
    collective it names, nccl-tests' size from its largest tensor (a reduce-scatter's input, an all-gather's output)
    at the annotation's element type, and the innermost annotation around it on the issuing thread (`issued_in`: the
    engine's range, "all-reduce word embedding grads", that says which group the collective served; gloo records no
    group ranks, ledger.evidence.trace_groups names them). An annotation no dispatcher op matches keeps what it
    shows (its input's bytes, None for an all-gather) and `issued_in` None;
  * point-to-point volumes: NCCL's SendRecv kernels carry no sizes (a batched isend/irecv runs as one coalesced
    kernel, its CPU side an `nccl:coalesced` range after the `c10d::send` / `c10d::recv_` ops it batches). Those
    dispatcher ops are recorded on every backend with their "Input Dims" (a TensorList: no element type), so P2P
    volume is kept as element counts per op (`p2p`) and the kernels' and gloo annotations' bytes are left empty:
    the reader multiplies by the size of the run's params dtype (what the pipeline sends);
  * compute intervals: non-communication GPU kernels, else the probes' forward/backward CPU annotations minus the
    annotations nested in them on the same thread that name a collective or a wait (a synchronous TP collective, the
    DDP pre-hook's all-gather wait): time the thread spent blocked is no compute.
"""
from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import InputError
from common.intervals import subtract, union
from ledger.evidence.trace_events import NO_ARGS, EventArgs, TraceEvent
from ledger.evidence.trace_stream import TraceStream

DTYPE_BYTES = {"float": 4, "float32": 4, "Float": 4, "double": 8, "Double": 8, "float64": 8, "c10::Half": 2,
               "Half": 2, "float16": 2, "c10::BFloat16": 2, "BFloat16": 2, "bfloat16": 2, "long int": 8, "Long": 8,
               "int64": 8, "int": 4, "Int": 4, "int32": 4, "unsigned char": 1, "Byte": 1, "uint8": 1, "bool": 1,
               "Bool": 1, "signed char": 1, "Char": 1, "int8": 1}
STEP_RE = re.compile(r"^ProfilerStep#(\d+)$")
# Collective kinds under one spelling, whatever the backend calls them.
_OPS = (("reduce_scatter", "reduce_scatter"), ("reducescatter", "reduce_scatter"), ("_reduce_scatter_base",
        "reduce_scatter"), ("all_gather", "all_gather"), ("allgather", "all_gather"), ("all_reduce", "all_reduce"),
        ("allreduce", "all_reduce"), ("all_to_all", "all_to_all"), ("alltoall", "all_to_all"),
        ("broadcast", "broadcast"), ("sendrecv", "send_recv"), ("send", "send"), ("recv", "recv"),
        ("barrier", "barrier"), ("reduce", "reduce"))
COMPUTE_PREFIXES = ("forward", "backward")
P2P_KINDS = ("send", "recv", "send_recv")
STALL_PREFIX = "wait "  # probes' stall ranges ("wait all-gather bucket3"): blocked time nested in compute
P2P_OPS = {"c10d::send": "send", "c10d::recv_": "recv"}
GLOO_ISSUERS = {"all_reduce": ("all_reduce", "reduce_scatter")}  # gloo runs a reduce-scatter as an all-reduce


def normalize_op(name: str) -> str | None:
    """The collective a name states first: "sp all-gather (reduce-scatter bwd)" is an all-gather (the engine names a
    backward collective after the forward one it conjugates). Needles found at the same place go by _OPS order, the
    longer spelling first ("reducescatter" before "reduce", "sendrecv" before "send")."""
    low = name.lower().replace("-", "_")
    found = [(low.find(needle), i) for i, (needle, _) in enumerate(_OPS) if needle in low]
    return _OPS[min(found)[1]][1] if found else None


@dataclass
class Collective:
    op: str
    start: float  # µs, the trace's own clock
    end: float
    bytes: int | None
    group: tuple[int, ...] | None
    seq: int | None = None
    thread: Any = None  # gloo: the worker thread it ran on (one process group's)
    # gloo: the innermost annotation around the c10d op that issued it ("" for none), None when none was matched
    issued_in: str | None = None
    # the group kind the evidence names (ledger.evidence.trace_groups): "" when it names none, None without evidence
    issued_as: str | None = None


@dataclass
class _Dispatch:
    """A dispatcher op `c10d::<op>` on the thread that issued a collective (gloo traces)."""
    op: str
    start: float
    tid: Any
    shapes: list[tuple[int, ...]]


@dataclass
class P2POp:
    """One send or receive as the dispatcher recorded it (CPU clock): its tensors' element count."""
    op: str  # "send" | "recv"
    start: float  # µs
    elements: int


@dataclass
class TraceSummary:
    path: Path
    rank: int | None
    world_size: int | None
    backend: str | None
    steps: dict[int, tuple[float, float]] = field(default_factory=dict)
    gpu_steps: dict[int, tuple[float, float]] = field(default_factory=dict)
    collectives: list[Collective] = field(default_factory=list)
    compute: list[tuple[float, float]] = field(default_factory=list)
    p2p: list[P2POp] = field(default_factory=list)
    on_gpu: bool = False
    run_id: str | None = None  # trainLedger.run_id, when the probes wrote it

    def windows(self) -> dict[int, tuple[float, float]]:
        """Step windows on the clock the collectives and compute were recorded on: the GPU-side ProfilerStep
        ranges when kernels were traced (kernels run after their CPU launch), else the CPU ones."""
        return self.gpu_steps if self.on_gpu and self.gpu_steps else self.steps


def distributed_info(meta: dict[str, Any]) -> dict[str, Any]:
    info = meta.get("distributedInfo")
    return info if isinstance(info, dict) else {}


def summarize(path: str | Path) -> TraceSummary:
    stream = TraceStream(path, TraceEvent)
    s = TraceSummary(path=Path(path), rank=None, world_size=None, backend=None)
    gpu_compute: list[tuple[float, float]] = []
    cpu_compute: dict[Any, list[tuple[float, float]]] = {}  # by thread
    blocked: dict[Any, list[tuple[float, float]]] = {}
    gloo: list[tuple[Collective, _Payload]] = []
    dispatches: list[_Dispatch] = []
    annotations: dict[Any, list[tuple[float, float, str]]] = {}  # by thread
    for e in stream:
        if e.ph != "X" or e.ts is None:
            continue
        start, end, name, cat = e.ts, e.ts + e.dur, e.name, e.cat
        if cat == "kernel":
            s.on_gpu = True
            if name[:4].lower() == "nccl":
                s.collectives.append(_nccl_collective(e, start, end))
            else:
                gpu_compute.append((start, end))
        elif cat == "cpu_op" and name.startswith("c10d::"):
            args = e.args or NO_ARGS
            if name in P2P_OPS:
                s.p2p.append(P2POp(op=P2P_OPS[name], start=start, elements=_tensor_list_elements(args)))
            op = normalize_op(name[len("c10d::"):])
            if op is not None:
                dispatches.append(_Dispatch(op, start, e.tid, _tensor_shapes(args)))
        elif cat == "user_annotation":
            m = STEP_RE.match(name)
            if m:
                s.steps[int(m.group(1))] = (start, end)
                continue
            if name.startswith("gloo:"):
                gloo.append(_gloo_collective(e, start, end))
            else:
                annotations.setdefault(e.tid, []).append((start, end, name))
            if name.startswith(COMPUTE_PREFIXES):
                cpu_compute.setdefault(e.tid, []).append((start, end))
            elif name.startswith(STALL_PREFIX) or normalize_op(name) is not None:
                blocked.setdefault(e.tid, []).append((start, end))
        elif cat == "gpu_user_annotation":
            m = STEP_RE.match(name)
            if m:
                s.gpu_steps[int(m.group(1))] = (start, end)
    info = distributed_info(stream.meta)
    s.rank, s.world_size, s.backend = as_int(info.get("rank")), as_int(info.get("world_size")), info.get("backend")
    s.run_id = _run_id(s.path, stream.meta)
    if not s.on_gpu:
        s.collectives = _link_gloo(gloo, dispatches, annotations)
    s.compute = union(gpu_compute) if s.on_gpu else _cpu_compute(cpu_compute, blocked)
    s.collectives.sort(key=lambda c: c.start)
    s.p2p.sort(key=lambda p: p.start)
    return s


def _cpu_compute(compute: dict[Any, list[tuple[float, float]]],
                 blocked: dict[Any, list[tuple[float, float]]]) -> list[tuple[float, float]]:
    """Forward/backward time of each thread without the time that thread spent blocked in a collective or a wait
    nested in it; a collective on another thread (gloo's worker) is the communication itself, not a hole."""
    return union(part for tid, spans in compute.items()
                 for part in subtract(union(spans), union(blocked.get(tid, []))))


def _tensor_list_elements(args: EventArgs) -> int:
    """Elements of a dispatcher op's first input, a TensorList ("Input Dims" [[[d0, d1, ...], ...], ...])."""
    dims = args.input_dims or []
    tensors = dims[0] if dims and isinstance(dims[0], list) else []
    return sum(math.prod(t) for t in tensors if isinstance(t, list))


def _nccl_collective(e: TraceEvent, start: float, end: float) -> Collective:
    args = e.args or NO_ARGS
    name = "" if args.collective_name is None else str(args.collective_name)
    op = normalize_op(name) or normalize_op(e.name) or "unknown"
    nbytes = None if op in P2P_KINDS else _nccl_bytes(args)  # P2P volume: from the dispatcher ops (`p2p`)
    return Collective(op=op, start=start, end=end, bytes=nbytes, group=group_ranks(args.group_ranks),
                      seq=as_int(args.seq))


def _nccl_bytes(args: EventArgs) -> int | None:
    """The larger of the input and output message: the buffer a collective moves, as nccl-tests count it."""
    size = DTYPE_BYTES.get(str(args.dtype))
    nin, nout = as_int(args.in_msg_nelems), as_int(args.out_msg_nelems)
    if size is None or (nin is None and nout is None):
        return None
    return max(nin or 0, nout or 0) * size


def _gloo_collective(e: TraceEvent, start: float, end: float) -> tuple[Collective, _Payload]:
    """What gloo's annotation shows alone: its input only, so an all-gather's size (its output, input x the group
    size) is unknown. P2P volume comes from the dispatcher ops (`p2p`), as on NCCL, so it is not counted twice.
    The input is returned beside it, for matching the annotation with the op that issued it (`_link_gloo`)."""
    op = normalize_op(e.name[len("gloo:"):]) or "unknown"
    payload = _payload(e.args or NO_ARGS)
    shape, size = payload
    nbytes = None
    if op not in ("all_gather",) + P2P_KINDS and shape is not None and size is not None:
        nbytes = math.prod(shape) * size
    return Collective(op=op, start=start, end=end, bytes=nbytes, group=None, thread=e.tid), payload


_Payload = tuple[tuple[int, ...] | None, int | None]


def _payload(args: EventArgs) -> _Payload:
    """A gloo annotation's first input: its shape and its element size."""
    dims, types = args.input_dims or [], args.input_type or []
    shape = tuple(dims[0]) if dims and isinstance(dims[0], list) else None
    return shape, DTYPE_BYTES.get(types[0]) if types else None


def _tensor_shapes(args: EventArgs) -> list[tuple[int, ...]]:
    """The shapes of every tensor a dispatcher op takes: a TensorList's members and plain tensors (whose "Input
    type" is their element type; scalars and other arguments have "", "Scalar", ...)."""
    out: list[tuple[int, ...]] = []
    for dims, kind in zip(args.input_dims or [], args.input_type or []):
        if kind == "TensorList" and isinstance(dims, list):
            out += [tuple(d) for d in dims if isinstance(d, list)]
        elif kind in DTYPE_BYTES and isinstance(dims, list):
            out.append(tuple(dims))
    return out


def _link_gloo(gloo: list[tuple[Collective, _Payload]], dispatches: list[_Dispatch],
               annotations: dict[Any, list[tuple[float, float, str]]]) -> list[Collective]:
    """Each gloo annotation read through the c10d op that issued it: the earliest unmatched dispatcher op of the same
    collective (a "gloo:all_reduce" may be a reduce-scatter's) that started no later and holds a tensor of the
    annotation's input shape. A process group runs its work in issue order, so the first such op is its issuer."""
    pending: dict[str, list[_Dispatch]] = {}
    for d in sorted(dispatches, key=lambda d: d.start):
        pending.setdefault(d.op, []).append(d)
    linked: list[tuple[Collective, _Dispatch]] = []
    for c, (shape, size) in sorted(gloo, key=lambda item: item[0].start):
        candidates = []
        for op in GLOO_ISSUERS.get(c.op, (c.op,)):
            i = _first_issuer(pending.get(op, []), c.start, shape)
            if i is not None:
                candidates.append((pending[op][i].start, op, i))
        if not candidates:
            continue
        _, op, i = min(candidates)
        d = pending[op].pop(i)
        c.op = d.op
        if d.op not in P2P_KINDS and d.shapes and size is not None:
            c.bytes = max(math.prod(s) for s in d.shapes) * size
        linked.append((c, d))
    for (c, _), name in zip(linked, _innermost(annotations, [d for _, d in linked])):
        c.issued_in = name
    return [c for c, _ in gloo]


def _first_issuer(queue: list[_Dispatch], start: float, shape: tuple[int, ...] | None) -> int | None:
    for i, d in enumerate(queue):
        if d.start > start:
            return None
        if shape in d.shapes:
            return i
    return None


def _innermost(annotations: dict[Any, list[tuple[float, float, str]]], dispatches: list[_Dispatch]) -> list[str]:
    """For each dispatcher op, the innermost annotation open on its thread when it started ("" for none): one sweep
    per thread with a stack, annotations on one thread being nested."""
    names = [""] * len(dispatches)
    by_thread: dict[Any, list[int]] = {}
    for i, d in enumerate(dispatches):
        by_thread.setdefault(d.tid, []).append(i)
    for tid, indices in by_thread.items():
        spans = sorted(annotations.get(tid, []), key=lambda a: (a[0], -a[1]))
        stack: list[tuple[float, float, str]] = []
        j = 0
        for i in sorted(indices, key=lambda i: dispatches[i].start):
            t = dispatches[i].start
            while j < len(spans) and spans[j][0] <= t:
                while stack and stack[-1][1] < spans[j][0]:
                    stack.pop()
                stack.append(spans[j])
                j += 1
            while stack and stack[-1][1] < t:
                stack.pop()
            names[i] = stack[-1][2] if stack else ""
    return names


def _run_id(path: Path, meta: dict[str, Any]) -> str | None:
    """trainLedger.run_id, which the probes write into every trace; None for a trace without one (Kineto's own, an
    older run's). A trainLedger block that cannot name its run is refused rather than read as "no run id": the
    foreign-trace check must not be skippable by a malformed block."""
    block = meta.get("trainLedger")
    if block is None:
        return None
    if not isinstance(block, dict):
        raise InputError(path, f"trainLedger is a {type(block).__name__}, expected an object")
    run_id = block.get("run_id")
    if run_id is not None and (not isinstance(run_id, str) or not run_id):
        raise InputError(path, f"trainLedger.run_id {run_id!r} is not a run id (a non-empty string)")
    return run_id


def group_ranks(ranks: Any) -> tuple[int, ...] | None:
    """A kernel's "Process Group Ranks" (a list, or its JSON text) as a tuple; None when it records none."""
    if isinstance(ranks, str):
        try:
            ranks = json.loads(ranks)
        except json.JSONDecodeError:
            return None
    if isinstance(ranks, list) and all(isinstance(r, int) for r in ranks):
        return tuple(ranks)
    return None


def as_int(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError, OverflowError):
        return None
