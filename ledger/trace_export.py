"""Merge per-rank torch.profiler traces into one Chrome trace that Perfetto UI and chrome://tracing open.

Layout: one process per rank, named with its coordinates ("rank 5 (tp1 dp0 pp1)") and sorted by rank; every
thread or CUDA stream of that rank's trace becomes a thread of it ("CPU thread 4711", "GPU 0 stream 7"). All other
events are kept as they are (user annotations, kernels, flows; flow / async ids are prefixed with the rank so that
ranks never join each other's arrows). The run's per-step memory figures become counter tracks of each rank
("memory_stats (bytes)": allocated / reserved / peak, "nvml used (bytes)"), placed at the end of the step's
ProfilerStep range, since the events' wall times and the trace clock share no anchor.

Clock skew: each host's trace has its own clock. A collective ends at the same instant on every member of its
group (no rank can leave a ring all-reduce before the last one has contributed), so for every pair of ranks that
share a process group the offset is the median, over their common collectives, of (end on the reference rank -
end on the other); collectives are matched by (group ranks, op, ProfilerStep, order within that step). Offsets
propagate breadth-first from the lowest selected rank over the pairs that share collectives; a rank that shares
none with the others (or a CPU trace without group ranks) keeps offset 0 and is named in `uncorrected`. The
median makes the estimate robust to the few collectives whose kernels end late for local reasons.

Memory: the offsets pass keeps a small index per trace (step windows, collective ends); the write pass streams one
trace's events at a time (ledger.traces.TraceStream) into the gzip output, so no trace is ever held whole. The output is
written to a temporary file and renamed, so a failure never leaves half a trace under the requested name.
"""
from __future__ import annotations

import json
from collections import defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any, Iterable, Iterator

from common.config import MAX_WORLD_SIZE
from common.errors import ConfigError, InputError
from common.run_dir import atomic_open, check_writable, events_path, read_manifest, trace_files
from common.run_dir import iter_events as iter_run_events
from ledger.reconcile.evidence import rank_coords
from ledger.reconcile.topology import rank_label
from ledger.traces import TraceStream, TraceSummary, summarize

MEMORY_KEYS = {"allocated": "allocated_bytes.all.current", "reserved": "reserved_bytes.all.current",
               "peak": "allocated_bytes.all.peak"}


@dataclass
class TraceIndex:
    """What the write pass needs of a trace, kept for every rank instead of its summary: the step windows and the
    collective ends the clock alignment matches."""
    steps: dict[int, tuple[float, float]]
    gpu_steps: dict[int, tuple[float, float]]
    ends: dict[tuple, float]


def index(summary: TraceSummary) -> TraceIndex:
    return TraceIndex(summary.steps, summary.gpu_steps, _match_keys(summary))


@dataclass
class ExportResult:
    out: Path
    ranks: list[int]
    offsets_us: dict[int, float]
    uncorrected: list[int] = field(default_factory=list)
    events: int = 0


def parse_steps(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        a, _, b = text.partition("-")
        lo, hi = int(a), int(b or a)
    except ValueError:
        raise ConfigError(f"--steps {text!r}: expected A-B, e.g. 10-12") from None
    if hi < lo or lo < 1:
        raise ConfigError(f"--steps {text!r}: expected steps 1 <= A <= B")
    return lo, hi


def parse_ranks(items: Iterable[str] | None) -> set[int] | None:
    """"0 1 4-7" or "0,1,4-7" -> {0, 1, 4, 5, 6, 7}."""
    if not items:
        return None
    out: set[int] = set()
    for item in items:
        for part in filter(None, item.split(",")):
            try:
                a, _, b = part.partition("-")
                lo, hi = int(a), int(b or a)
            except ValueError:
                raise ConfigError(f"--ranks {part!r}: expected ranks like 0,1,4-7") from None
            if not 0 <= lo <= hi < MAX_WORLD_SIZE:
                raise ConfigError(f"--ranks {part!r}: expected ranks 0 <= A <= B < {MAX_WORLD_SIZE:,}")
            out.update(range(lo, hi + 1))
    return out


def _match_keys(s: TraceSummary) -> dict[tuple, float]:
    """(group, op, step, index in step) -> collective end (µs), for collectives whose group ranks are known."""
    keys: dict[tuple, float] = {}
    counters: dict[tuple, int] = defaultdict(int)
    windows = s.windows()
    for c in s.collectives:
        if c.group is None:
            continue
        step = next((n for n, (lo, hi) in windows.items() if lo <= c.start <= hi), None)
        if step is None:
            continue
        base = (tuple(sorted(c.group)), c.op, step)
        keys[base + (counters[base],)] = c.end
        counters[base] += 1
    return keys


def clock_offsets(indexes: dict[int, TraceIndex]) -> tuple[dict[int, float], list[int]]:
    """Offset (µs) to add to each rank's timestamps, and the ranks that could not be aligned."""
    keys = {rank: ix.ends for rank, ix in indexes.items()}
    ranks = sorted(indexes)
    pair: dict[tuple[int, int], float] = {}
    for i, a in enumerate(ranks):
        for b in ranks[i + 1:]:
            common = keys[a].keys() & keys[b].keys()
            if common:
                pair[(a, b)] = median(keys[a][k] - keys[b][k] for k in common)
                pair[(b, a)] = -pair[(a, b)]
    offsets: dict[int, float] = {}
    for root in ranks:
        if root in offsets:
            continue
        offsets[root] = 0.0
        queue = deque([root])
        while queue:
            a = queue.popleft()
            for b in ranks:
                if b not in offsets and (a, b) in pair:
                    offsets[b] = offsets[a] + pair[(a, b)]
                    queue.append(b)
    linked = {a for a, _ in pair}
    uncorrected = [r for r in ranks if r not in linked] if len(ranks) > 1 else []
    return offsets, uncorrected


def export(run_dir: str | Path, out: str | Path, steps: tuple[int, int] | None = None,
           ranks: set[int] | None = None) -> ExportResult:
    run_dir, out = Path(run_dir), check_writable(out)
    manifest = read_manifest(run_dir)
    files = [(r, p) for r, _, _, p in trace_files(run_dir) if ranks is None or r in ranks]
    if not files:
        raise InputError(run_dir / "traces", "no traces" + (f" for ranks {sorted(ranks)}" if ranks else ""))
    indexes = {rank: index(_checked(summarize(path), rank, path, manifest)) for rank, path in files}
    if steps is not None and not any(_selected(ix.steps, steps) for ix in indexes.values()):
        raise ConfigError(f"--steps {steps[0]}-{steps[1]}: no trace holds those steps")
    offsets, uncorrected = clock_offsets(indexes)
    result = ExportResult(out=out, ranks=[r for r, _ in files], offsets_us=offsets, uncorrected=uncorrected)
    with atomic_open(out) as f:
        f.write('{"displayTimeUnit": "ms", "otherData": ')
        f.write(json.dumps({"run_id": manifest.get("run_id"), "clock_offsets_us": offsets,
                            "uncorrected_ranks": uncorrected,
                            "clock_alignment": "median collective-end difference per rank pair, see "
                                               "ledger/trace_export.py"}))
        f.write(', "traceEvents": [\n')
        first = True
        for rank, path in files:
            for event in rank_events(run_dir, manifest, rank, path, indexes[rank], offsets[rank], steps):
                f.write(("" if first else ",\n") + json.dumps(event, separators=(",", ":")))
                first = False
                result.events += 1
        f.write("\n]}\n")
    return result


def _checked(s: TraceSummary, rank: int, path: Path, manifest: dict[str, Any]) -> TraceSummary:
    if s.run_id is not None and s.run_id != manifest.get("run_id"):
        raise InputError(path, f"trace from another run: run_id {s.run_id!r}, manifest says {manifest.get('run_id')!r}")
    if s.rank is not None and s.rank != rank:
        raise InputError(path, f"distributedInfo says rank {s.rank}, the file name rank {rank}")
    if s.world_size is not None and s.world_size != manifest["world_size"]:
        raise InputError(path, f"trace from another run: world size {s.world_size}, this run's is "
                               f"{manifest['world_size']}")
    return s


def _selected(windows: dict[int, tuple[float, float]], steps: tuple[int, int]) -> list[int]:
    return [n for n in windows if steps[0] <= n <= steps[1]]


def _time_range(s: TraceIndex, steps: tuple[int, int] | None) -> tuple[float, float] | None:
    if steps is None:
        return None
    spans = [w[n] for w in (s.steps, s.gpu_steps) for n in _selected(w, steps)]
    if not spans:
        return (0.0, -1.0)  # nothing of this rank is in the window
    return min(a for a, _ in spans), max(b for _, b in spans)


def rank_events(run_dir: Path, manifest: dict[str, Any], rank: int, path: Path, ix: TraceIndex,
                offset: float, steps: tuple[int, int] | None) -> Iterator[dict[str, Any]]:
    coords = rank_coords(manifest, rank)
    yield {"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": rank_label(rank, coords)}}
    yield {"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}}
    span = _time_range(ix, steps)
    threads: dict[tuple[Any, Any], int] = {}
    names: dict[tuple[Any, Any], str] = {}
    for e in TraceStream(path):
        if e.get("ph") == "M":
            if e.get("name") == "thread_name":
                names[(e.get("pid"), e.get("tid"))] = str((e.get("args") or {}).get("name", ""))
            continue
        ts = e.get("ts")
        if span is not None and ts is not None and not span[0] <= float(ts) < span[1]:
            continue
        key = (e.get("pid"), e.get("tid"))
        if key not in threads:
            threads[key] = len(threads) + 1
            yield {"ph": "M", "name": "thread_name", "pid": rank, "tid": threads[key],
                   "args": {"name": _thread_name(key, names.get(key))}}
        out = dict(e, pid=rank, tid=threads[key])
        if ts is not None:
            out["ts"] = float(ts) + offset
        if "id" in out and out.get("ph") in ("s", "t", "f", "b", "e", "n"):
            out["id"] = f"{rank}:{out['id']}"
        yield out
    yield from memory_counters(run_dir, rank, ix, offset, steps)


def _thread_name(key: tuple[Any, Any], kineto_name: str | None) -> str:
    pid, tid = key
    if isinstance(pid, int) and pid < 1000 and not kineto_name:  # Kineto gives GPU events pid = device index
        return f"GPU {pid} stream {tid}"
    return kineto_name or f"CPU thread {tid}"


def memory_counters(run_dir: Path, rank: int, ix: TraceIndex, offset: float,
                    steps: tuple[int, int] | None) -> Iterator[dict[str, Any]]:
    """Counter events from the rank's per-step memory and NVML records, at the end of each traced step."""
    if not events_path(run_dir, rank).is_file():
        return
    windows = ix.steps
    nvml: dict[int, int] = {}
    for record in iter_run_events(run_dir, rank, {"memory", "nvml"}):
        step = record.get("step")
        if step not in windows or (steps is not None and not steps[0] <= step <= steps[1]):
            continue
        ts = windows[step][1] + offset
        if record["kind"] == "nvml" and "used_bytes" in record:
            nvml[step] = max(nvml.get(step, 0), int(record["used_bytes"]))
        elif record["kind"] == "memory" and record.get("point") == "step":
            args = {name: record[key] for name, key in MEMORY_KEYS.items() if key in record}
            if not args and "rss_bytes" in record:
                args = {"rss": record["rss_bytes"]}
            if args:
                yield {"ph": "C", "name": "memory (bytes)", "pid": rank, "tid": 0, "ts": ts, "args": args}
    for step, used in sorted(nvml.items()):
        yield {"ph": "C", "name": "nvml used (bytes)", "pid": rank, "tid": 0, "ts": windows[step][1] + offset,
               "args": {"used": used}}

