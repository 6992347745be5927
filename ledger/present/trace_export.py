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
end on the other); collectives are matched by (group ranks, op, ProfilerStep, order within that step). A gloo trace
records no group ranks: ledger.evidence.trace_groups names them from the engine's ranges, the worker threads and
the rank's groups, as reconcile does. Offsets propagate breadth-first from the lowest selected rank over the pairs
that share collectives; a rank that shares none with the others keeps offset 0 and is named in `uncorrected`, and
`alignment_lines` says, rank by rank, which collectives it was aligned on or why it could not be. The median makes
the estimate robust to the few collectives whose kernels end late for local reasons.

Memory: the offsets pass keeps a small index per trace (step windows, collective ends); the write pass streams one
trace's events at a time (ledger.evidence.traces.TraceStream) into the gzip output, so no trace is ever held whole. The output is
written to a temporary file and renamed, so a failure never leaves half a trace under the requested name.
"""
from __future__ import annotations

import json
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any, Callable, Iterable, Iterator

from common.config import MAX_WORLD_SIZE
from common.errors import ConfigError, InputError
from common.run_dir import atomic_open, check_writable, events_path, read_manifest, trace_files
from common.run_dir import iter_events as iter_run_events
from ledger.evidence.run import rank_coords
from ledger.evidence.trace_groups import NONE, P2P, RECORDED, RULES, attribute_groups, range_kinds
from ledger.evidence.trace_stream import TraceStream
from ledger.evidence.traces import P2P_KINDS, TraceSummary, summarize
from ledger.reconcile.topology import group_kind, rank_groups, rank_label

MEMORY_KEYS = {"allocated": "allocated_bytes.all.current", "reserved": "reserved_bytes.all.current",
               "peak": "allocated_bytes.all.peak"}


@dataclass
class TraceIndex:
    """What the write pass and the alignment need of a trace, kept for every rank instead of its summary: the step
    windows, the collective ends the clock alignment matches (with a label each: group kind and op) and how many
    collectives fell in a step window at all."""
    steps: dict[int, tuple[float, float]]
    gpu_steps: dict[int, tuple[float, float]]
    ends: dict[tuple, float]
    labels: dict[tuple, str] = field(default_factory=dict)
    in_steps: int = 0  # collectives (not point-to-point) inside a ProfilerStep
    named_by: dict[str, int] = field(default_factory=dict)  # ledger.evidence.trace_groups's count per rule


def index(summary: TraceSummary, groups: dict[str, tuple[int, ...]] | None = None,
          named_by: dict[str, int] | None = None) -> TraceIndex:
    ix = TraceIndex(summary.steps, summary.gpu_steps, {}, named_by=named_by or {})
    counters: dict[tuple, int] = defaultdict(int)
    windows = summary.windows()
    for c in summary.collectives:
        step = next((n for n, (lo, hi) in windows.items() if lo <= c.start <= hi), None)
        if step is None or c.op in P2P_KINDS:
            continue
        ix.in_steps += 1
        if c.group is None:
            continue
        base = (tuple(sorted(c.group)), c.op, step)
        key = base + (counters[base],)
        counters[base] += 1
        ix.ends[key] = c.end
        ix.labels[key] = f"{group_kind(groups, c.group, c.op, c.issued_as)} {c.op}" if groups is not None else c.op
    return ix


@dataclass
class Alignment:
    offsets: dict[int, float]  # µs to add to each rank's timestamps
    parent: dict[int, int]  # rank -> the rank whose clock its offset was measured against
    shared: dict[tuple[int, int], Counter[str]]  # (a, b), a < b -> the labels of the collectives both traced
    uncorrected: list[int]  # ranks that share no collective with any other


@dataclass
class ExportResult:
    out: Path
    ranks: list[int]
    alignment: Alignment
    indexes: dict[int, TraceIndex]
    selected: bool = False  # --ranks narrowed the traces
    events: int = 0

    @property
    def offsets_us(self) -> dict[int, float]:
        return self.alignment.offsets

    @property
    def uncorrected(self) -> list[int]:
        return self.alignment.uncorrected


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


def clock_offsets(indexes: dict[int, TraceIndex]) -> Alignment:
    """Each rank's offset (µs) from the medians of its shared collectives' end differences, propagated breadth-first
    from the lowest rank of each connected set of ranks."""
    ranks = sorted(indexes)
    pair: dict[tuple[int, int], float] = {}
    shared: dict[tuple[int, int], Counter[str]] = {}
    for i, a in enumerate(ranks):
        for b in ranks[i + 1:]:
            common = indexes[a].ends.keys() & indexes[b].ends.keys()
            if common:
                pair[(a, b)] = median(indexes[a].ends[k] - indexes[b].ends[k] for k in common)
                pair[(b, a)] = -pair[(a, b)]
                shared[(a, b)] = Counter(indexes[a].labels.get(k, k[1]) for k in common)
    offsets: dict[int, float] = {}
    parent: dict[int, int] = {}
    for root in ranks:
        if root in offsets:
            continue
        offsets[root] = 0.0
        queue = deque([root])
        while queue:
            a = queue.popleft()
            for b in ranks:
                if b not in offsets and (a, b) in pair:
                    offsets[b], parent[b] = offsets[a] + pair[(a, b)], a
                    queue.append(b)
    linked = {a for a, _ in pair}
    uncorrected = [r for r in ranks if r not in linked] if len(ranks) > 1 else []
    return Alignment(offsets, parent, shared, uncorrected)


def alignment_lines(result: ExportResult) -> list[str]:
    """What the clock alignment did, one line per rank: the reference, each aligned rank's offset with the rank and
    the collectives it was measured on, each rank left at offset 0 with the reason; then, for traces that record no
    group ranks (gloo), how many of their collectives were given one."""
    a, ranks = result.alignment, result.ranks
    if len(ranks) == 1:
        only = f"only rank {ranks[0]} was selected" if result.selected else \
            f"rank {ranks[0]} is the only rank with a trace"
        lines = [f"clock alignment: nothing to align: {only}"]
    else:
        roots = [r for r in ranks if r not in a.parent]
        lines = [f"clock alignment: rank {roots[0]} is the reference (offset 0)"]
        for r in ranks:
            if r in a.parent:
                p = a.parent[r]
                labels = a.shared[(min(p, r), max(p, r))]
                lines.append(f"rank {r}: {a.offsets[r]:+.1f} µs, from rank {p} over {sum(labels.values())} shared "
                             f"collectives ({', '.join(f'{k} {n}' for k, n in sorted(labels.items()))})")
            elif r != roots[0]:
                lines.append(f"rank {r}: not aligned (offset 0): {_unaligned(r, result)}")
    return lines + [line for r in ranks for line in _naming_line(r, result.indexes[r])]


def _unaligned(rank: int, result: ExportResult) -> str:
    a, ix = result.alignment, result.indexes[rank]
    if rank not in a.uncorrected:
        component = sorted(r for r in result.ranks if _root(r, a) == _root(rank, a))
        return f"aligned with ranks {component} only: they share no collective with rank {result.ranks[0]}'s ranks"
    if ix.in_steps == 0:
        return "its trace holds no collective inside a ProfilerStep"
    if not ix.ends:
        return (f"none of its {ix.in_steps} collectives has known group ranks (the trace records none, and no engine "
                f"range, worker thread or single group of several ranks names one)")
    groups = sorted({k[0] for k in ix.ends})
    peers = sorted(r for r in result.ranks if r != rank and any(r in g for g in groups))
    if not peers:
        return (f"no other exported rank is in the groups its collectives ran on "
                f"({', '.join(str(list(g)) for g in groups)})")
    return (f"it shares groups with rank{'s' if len(peers) > 1 else ''} {', '.join(map(str, peers))} but no collective "
            f"matched on (group, op, ProfilerStep, order): its steps {_steps(ix)}, "
            f"theirs {', '.join(_steps(result.indexes[p]) for p in peers)}")


def _root(rank: int, a: Alignment) -> int:
    while rank in a.parent:
        rank = a.parent[rank]
    return rank


def _steps(ix: TraceIndex) -> str:
    return f"{min(ix.steps)}-{max(ix.steps)}" if ix.steps else "none"


def _naming_line(rank: int, ix: TraceIndex) -> list[str]:
    rules = {k: ix.named_by[k] for k in RULES if k in ix.named_by and k not in (RECORDED, P2P)}
    if not rules:
        return []
    total, unnamed = sum(rules.values()), rules.get(NONE, 0)
    detail = ", ".join(f"{k} {n}" for k, n in rules.items() if k != NONE)
    why = (f"; {unnamed} left unnamed (issued outside the engine's communication ranges, on worker threads no named "
           f"collective ran on, by a rank in several groups of more than one rank)") if unnamed else ""
    return [f"rank {rank}: its trace records no process group ranks (gloo's does not); the ledger named the groups of "
            f"{total - unnamed} of its {total} collectives" + (f" ({detail})" if detail else "") + why]


def export(run_dir: str | Path, out: str | Path, steps: tuple[int, int] | None = None,
           ranks: set[int] | None = None, progress: Callable[[str], None] = lambda _: None) -> ExportResult:
    run_dir, out = Path(run_dir), check_writable(out)
    manifest = read_manifest(run_dir)
    files = [(r, p) for r, _, _, p in trace_files(run_dir) if ranks is None or r in ranks]
    if not files:
        raise InputError(run_dir / "traces", "no traces" + (f" for ranks {sorted(ranks)}" if ranks else ""))
    indexes = {}
    for i, (rank, path) in enumerate(files, 1):
        progress(f"reading trace {i}/{len(files)} (rank {rank})")
        indexes[rank] = _indexed(run_dir, manifest, rank, path)
    if steps is not None and not any(_selected(ix.steps, steps) for ix in indexes.values()):
        raise ConfigError(f"--steps {steps[0]}-{steps[1]}: no trace holds those steps")
    result = ExportResult(out=out, ranks=[r for r, _ in files], alignment=clock_offsets(indexes), indexes=indexes,
                          selected=ranks is not None)
    offsets = result.offsets_us
    with atomic_open(out) as f:
        f.write('{"displayTimeUnit": "ms", "otherData": ')
        f.write(json.dumps({"run_id": manifest.get("run_id"), "clock_offsets_us": offsets,
                            "uncorrected_ranks": result.uncorrected,
                            "clock_alignment": "median collective-end difference per rank pair, see "
                                               "ledger/present/trace_export.py",
                            "clock_alignment_lines": alignment_lines(result)}))
        f.write(', "traceEvents": [\n')
        first = True
        for i, (rank, path) in enumerate(files, 1):
            progress(f"writing rank {rank} ({i}/{len(files)}), {result.events:,} events so far")
            for event in rank_events(run_dir, manifest, rank, path, indexes[rank], offsets[rank], steps):
                f.write(("" if first else ",\n") + json.dumps(event, separators=(",", ":")))
                first = False
                result.events += 1
        f.write("\n]}\n")
    return result


def _indexed(run_dir: Path, manifest: dict[str, Any], rank: int, path: Path) -> TraceIndex:
    """A trace's index, its collectives given the group ranks its trace may lack (ledger.evidence.trace_groups)."""
    summary = _checked(summarize(path), rank, path, manifest)
    groups = rank_groups(manifest, rank)
    timing = iter_run_events(run_dir, rank, {"timing"}) if events_path(run_dir, rank).is_file() else []
    named = attribute_groups(summary, groups, int(manifest["world_size"]), range_kinds(timing))
    return index(named.summary, groups, named.named_by)


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

