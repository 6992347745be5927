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

Work and memory: the offsets pass summarises the traces in worker processes (ledger.evidence.trace_pool) and keeps
a small index per trace (step windows, collective ends); the write pass has each worker stream one rank's events,
a batch at a time, into a compressed part of its own (ledger.present.rank_trace), and the parts are joined in rank
order into one gzip member (ledger.present.gzip_join), so no trace is ever held whole. The output is written to a
temporary file and renamed, so a failure never leaves half a trace under the requested name.
"""
from __future__ import annotations

import json
import os
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Callable

from common.errors import ConfigError, InputError
from common.run_dir import atomic_open, check_writable
from ledger.evidence.layout import group_kind
from ledger.evidence.run import RunEvidence
from ledger.evidence.trace_groups import NONE, P2P, RECORDED, RULES, attribute_groups, range_kinds
from ledger.evidence.trace_pool import in_workers, pool_size, read_trace_summaries
from ledger.evidence.traces import P2P_KINDS, TraceSummary
from ledger.present.gzip_join import Joined, Part, part_of
from ledger.present.rank_trace import RankPart, write_part
from ledger.present.units import rank_label


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


def export(ev: RunEvidence, out: str | Path, steps: tuple[int, int] | None = None,
           ranks: set[int] | None = None, progress: Callable[[str], None] = lambda _: None,
           workers: int | None = None) -> ExportResult:
    out = check_writable(out)
    files = [(t.rank, t.path) for t in ev.traces if ranks is None or t.rank in ranks]
    if not files:
        raise InputError(ev.run_dir / "traces", "no traces" + (f" for ranks {sorted(ranks)}" if ranks else ""))
    summaries = read_trace_summaries(files, workers, progress)
    traces = {t.path: t for t in ev.traces}
    indexes = {rank: _indexed(ev, rank, ev.checked(summaries.pop(path), traces[path])) for rank, path in files}
    if steps is not None and not any(_selected(ix.steps, steps) for ix in indexes.values()):
        raise ConfigError(f"--steps {steps[0]}-{steps[1]}: no trace holds those steps")
    result = ExportResult(out=out, ranks=[r for r, _ in files], alignment=clock_offsets(indexes), indexes=indexes,
                          selected=ranks is not None)
    compress = out.name.endswith(".gz")
    jobs = [RankPart(rank_label(rank, ev.coords(rank)), ev.rank_evidence(rank).memory_steps,
                     ev.rank_evidence(rank).nvml, rank, path, indexes[rank].steps, indexes[rank].gpu_steps,
                     result.offsets_us[rank], steps, i == 0, out.with_name(f".{out.name}.rank{rank}.{os.getpid()}"),
                     compress) for i, (rank, path) in enumerate(files)]
    head = json.dumps({"run_id": ev.run_id, "clock_offsets_us": result.offsets_us,
                       "uncorrected_ranks": result.uncorrected,
                       "clock_alignment": "median collective-end difference per rank pair, see "
                                          "ledger/present/trace_export.py",
                       "clock_alignment_lines": alignment_lines(result)})
    try:
        with atomic_open(out, raw=True) as f:
            joined = Joined(f, compress)
            joined.add(part_of(f'{{"displayTimeUnit": "ms", "otherData": {head}, "traceEvents": [\n'.encode(),
                               compress))
            count = pool_size(workers, [p for _, p in files])
            progress(f"writing {len(jobs)} rank{'s' if len(jobs) > 1 else ''}" +
                     (f" in {count} processes" if count > 1 else ""))
            for i, (job, (events, crc, length)) in enumerate(zip(jobs, in_workers(write_part, jobs, count)), 1):
                joined.add(Part(job.part, crc, length))
                job.part.unlink()
                result.events += events
                progress(f"wrote rank {job.rank} ({i}/{len(jobs)}), {result.events:,} events so far")
            joined.add(part_of(b"\n]}\n", compress))
            joined.close()
    finally:
        for job in jobs:
            job.part.unlink(missing_ok=True)
    return result


def _indexed(ev: RunEvidence, rank: int, summary: TraceSummary) -> TraceIndex:
    """A trace's index, its collectives given the group ranks its trace may lack (ledger.evidence.trace_groups)."""
    groups = ev.groups(rank)
    named = attribute_groups(summary, groups, ev.world_size, range_kinds(ev.rank_evidence(rank).timing))
    return index(named.summary, groups, named.named_by)


def _selected(windows: dict[int, tuple[float, float]], steps: tuple[int, int]) -> list[int]:
    return [n for n in windows if steps[0] <= n <= steps[1]]
