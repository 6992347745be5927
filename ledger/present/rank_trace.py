"""One rank's part of the merged Perfetto trace (ledger.present.trace_export), written by a worker process.

The rank's events are streamed a batch at a time, each decoded only to its top level: a dict from field to its raw
JSON text (msgspec.Raw), so args, kernel details and every field the merge does not change are written back exactly
as read, without being built as Python objects. Only the fields the merge rewrites are decoded: pid and tid (one
thread of the rank's process per Kineto thread or stream), ts (shifted by the rank's clock offset, and filtered
to --steps), flow / async ids (prefixed with the rank). A batch is encoded in one call and compressed into the
worker's part (ledger.present.gzip_join), so a worker holds one batch at a time.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import msgspec

from common.events import MemoryRecord, NvmlRecord
from ledger.evidence.trace_stream import TraceStream
from ledger.present.gzip_join import PartWriter

MEMORY_KEYS = {"allocated": "allocated_bytes.all.current", "reserved": "reserved_bytes.all.current",
               "peak": "allocated_bytes.all.peak"}
METADATA, THREAD_NAME = msgspec.Raw(b'"M"'), msgspec.Raw(b'"thread_name"')
WITH_IDS = [msgspec.Raw(f'"{ph}"'.encode()) for ph in ("s", "t", "f", "b", "e", "n")]  # flow and async phases
Windows = dict[int, tuple[float, float]]


@dataclass(frozen=True)
class RankPart:
    """What a worker needs to write one rank's events into `part`."""
    label: str  # the rank's process name: rank and coordinates
    memory: list[MemoryRecord]  # its per-step memory and NVML records, drawn as counters
    nvml: list[NvmlRecord]
    rank: int
    trace: Path
    steps: Windows  # the trace's ProfilerStep windows (CPU), where memory counters are placed
    gpu_steps: Windows
    offset: float  # µs added to every timestamp
    selected: tuple[int, int] | None  # --steps
    first: bool  # the first part of the traceEvents list: no comma before it
    part: Path
    compress: bool


def write_part(job: RankPart) -> tuple[int, int, int]:
    """(events, CRC-32 of the text, its length) of the rank's part, written as a comma-separated run of events."""
    encoder = msgspec.json.Encoder()
    events, sep = 0, b"" if job.first else b",\n"
    with open(job.part, "wb") as f:
        writer = PartWriter(f, job.compress)
        for batch in rank_batches(job):
            if batch:
                writer.write(sep + encoder.encode(batch)[1:-1])
                sep, events = b",\n", events + len(batch)
        crc, length = writer.finish()
    return events, crc, length


def rank_batches(job: RankPart) -> Iterator[list[dict[str, Any]]]:
    rank = job.rank
    yield [{"ph": "M", "name": "process_name", "pid": rank, "tid": 0,
            "args": {"name": job.label}},
           {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}}]
    span = time_range(job.steps, job.gpu_steps, job.selected)
    threads: dict[tuple[bytes, bytes], int] = {}
    names: dict[tuple[bytes, bytes], str] = {}
    for batch in TraceStream(job.trace, dict[str, msgspec.Raw]).batches():
        out: list[dict[str, Any]] = []
        for e in batch:
            key = (bytes(e.get("pid", b"")), bytes(e.get("tid", b"")))
            if e.get("ph") == METADATA:
                if e.get("name") == THREAD_NAME:
                    names[key] = str((_value(e.get("args")) or {}).get("name", ""))
                continue
            ts = _value(e.get("ts"))
            if span is not None and ts is not None and not span[0] <= float(ts) < span[1]:
                continue
            if key not in threads:
                threads[key] = len(threads) + 1
                out.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": threads[key],
                            "args": {"name": _thread_name(_value(e.get("pid")), _value(e.get("tid")),
                                                          names.get(key))}})
            e["pid"], e["tid"] = rank, threads[key]
            if ts is not None:
                e["ts"] = float(ts) + job.offset
            if "id" in e and e.get("ph") in WITH_IDS:
                e["id"] = f"{rank}:{_value(e['id'])}"
            out.append(e)
        yield out
    yield list(memory_counters(job))


def _value(raw: msgspec.Raw | None) -> Any:
    return None if raw is None else msgspec.json.decode(raw)


def _selected(windows: Windows, steps: tuple[int, int]) -> list[int]:
    return [n for n in windows if steps[0] <= n <= steps[1]]


def time_range(steps: Windows, gpu_steps: Windows, selected: tuple[int, int] | None) -> tuple[float, float] | None:
    """The trace-clock span of the --steps selection on this rank, CPU and GPU sides both; None: no selection."""
    if selected is None:
        return None
    spans = [w[n] for w in (steps, gpu_steps) for n in _selected(w, selected)]
    if not spans:
        return (0.0, -1.0)  # nothing of this rank is in the window
    return min(a for a, _ in spans), max(b for _, b in spans)


def _thread_name(pid: Any, tid: Any, kineto_name: str | None) -> str:
    if isinstance(pid, int) and pid < 1000 and not kineto_name:  # Kineto gives GPU events pid = device index
        return f"GPU {pid} stream {tid}"
    return kineto_name or f"CPU thread {tid}"


def memory_counters(job: RankPart) -> Iterator[dict[str, Any]]:
    """Counter events from the rank's per-step memory and NVML records, at the end of each traced step."""
    windows, rank, offset = job.steps, job.rank, job.offset

    def shown(step: int | None) -> bool:
        return step in windows and (job.selected is None or job.selected[0] <= step <= job.selected[1])  # type: ignore[operator]

    for m in job.memory:
        if m.point != "step" or not shown(m.step):
            continue
        args = {name: m.figure(key) for name, key in MEMORY_KEYS.items() if m.figure(key) is not None}
        if not args and m.rss_bytes is not None:
            args = {"rss": m.rss_bytes}
        if args:
            yield {"ph": "C", "name": "memory (bytes)", "pid": rank, "tid": 0, "ts": windows[m.step][1] + offset,
                   "args": args}
    nvml: dict[int, int] = {}
    for n in job.nvml:
        if shown(n.step) and n.used_bytes is not None:
            nvml[n.step] = max(nvml.get(n.step, 0), n.used_bytes)  # type: ignore[index]
    for step, used in sorted(nvml.items()):
        yield {"ph": "C", "name": "nvml used (bytes)", "pid": rank, "tid": 0, "ts": windows[step][1] + offset,
               "args": {"used": used}}
