"""A run directory -> reconciliation rows and what is missing; written as RUN/ledger/reconciliation.json and .csv.

Order of work: events are gathered per rank (small records), then the traces are summarised in parallel
(ledger.evidence.trace_pool: worker processes each stream whole traces and send back only a summary), each summary
is checked against the manifest and turned into rows, and the HTA cross-check runs last on a bounded subset of ranks
(ledger.reconcile.hta). Everything is computed before anything is written, and each output file is written
atomically: bad input leaves nothing half-written.
"""
from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from common.config import RunConfig
from common.errors import InputError
from common.run_dir import LEDGER_DIR, atomic_write_text
from ledger.evidence.megatron import ingest as ingest_megatron
from ledger.evidence.run import RankEvidence, RunEvidence, collect_run, cpu_sharing, rank_backend, rank_coords
from ledger.evidence.steps import StepSelection, select_steps
from ledger.evidence.trace_groups import attribute_groups, range_kinds
from ledger.evidence.trace_pool import read_trace_summaries
from ledger.evidence.traces import TraceSummary
from ledger.reconcile import hta, oversubscribed
from ledger.reconcile.checkpoint import checkpoint_rows
from ledger.reconcile.comm import p2p_element_bytes, trace_volume, untraceable_ops, volume_rows
from ledger.reconcile.memory import memory_rows
from ledger.reconcile.moe import moe_rows
from ledger.reconcile.overlap import overlap_rows, trace_overlap_rows
from ledger.reconcile.pipeline import pipeline_rows
from ledger.reconcile.rows import FIELDS, VERDICTS, Row
from ledger.reconcile.throughput import throughput_rows
from ledger.reconcile.time_rows import TimeModel, explain_step_time, predict_run, time_rows
from ledger.reconcile.topology import groups_rows, rank_groups

JSON_NAME = "reconciliation.json"
CSV_NAME = "reconciliation.csv"


@dataclass
class Reconciliation:
    run_dir: Path
    run: dict[str, Any]
    rows: list[Row]
    missing: list[str] = field(default_factory=list)

    def verdict_counts(self) -> dict[str, int]:
        """Rows per verdict; "identity" rows (agreeing by construction) are counted apart, never as "ok"."""
        counts = dict.fromkeys(VERDICTS, 0)
        for r in self.rows:
            counts[r.verdict] += 1
        return counts

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run, "verdicts": self.verdict_counts(), "missing": self.missing,
                "rows": [r.to_dict() for r in self.rows]}


def gather(run_dir: str | Path) -> RunEvidence:
    run_dir = Path(run_dir)
    if ingest_megatron.is_megatron_run(run_dir):
        return ingest_megatron.collect(run_dir)
    return collect_run(run_dir)


@dataclass(frozen=True)
class TraceWork:
    """How a reconciliation reads the run's traces: worker processes (None: ledger.evidence.trace_pool decides),
    the HTA cross-check's ranks and budget, and where progress lines go."""
    workers: int | None = None
    hta: hta.HtaChoice = hta.HtaChoice()
    progress: Callable[[str], None] = lambda _: None


def reconcile(run_dir: str | Path, work: TraceWork = TraceWork()) -> Reconciliation:
    return reconcile_evidence(gather(run_dir), work)


def reconcile_evidence(ev: RunEvidence, work: TraceWork = TraceWork()) -> Reconciliation:
    """The rows of evidence already gathered (a caller that also needs the evidence itself reads the run once)."""
    selection = run_steps(ev)
    model = predict_run(ev)
    traced = {rank for rank, _, _, _ in ev.traces}
    rows = groups_rows(ev.manifest) + memory_rows(ev) + pipeline_rows(ev, model, selection)
    for rank, r in sorted(ev.ranks.items()):
        rows += overlap_rows(ev.config, r, selection, rank in traced, **exposed_predictions(ev.config, model, r))
    cross_check: dict[int, hta.CrossCheck] = {}
    summaries = read_trace_summaries([(rank, path) for rank, _, _, path in ev.traces], work.workers, work.progress)
    for rank, _, _, path in ev.traces:
        summary = checked_summary(ev, rank, summaries.pop(path))
        r = ev.ranks.get(rank) or RankEvidence(rank=rank, coords=rank_coords(ev.manifest, rank))
        rows += trace_rows(ev, r, summary, selection, model)
        cross_check[rank] = hta.cross_check_input(summary)
    for rank, r in ev.ranks.items():
        if rank not in traced:
            rows += volume_rows(ev.config, r, None)
    rows += throughput_rows(ev, selection, predicted_step_time=model.step.step_time if model.step else None)
    explain_step_time(rows, ev, model, selection)
    rows += time_rows(ev, model, selection)
    rows += moe_rows(ev, model, selection)
    rows += checkpoint_rows(ev)
    not_judged = oversubscribed.set_aside(rows, cpu_sharing(ev.manifest))
    check_rows, skipped = hta.hta_rows(cross_check, work.hta, work.workers, work.progress)
    rows += check_rows
    run = {"run_id": ev.manifest.get("run_id"), "framework": ev.framework, "status": ev.manifest.get("status"),
           "world_size": ev.world_size, "ranks_with_events": sorted(ev.ranks),
           "traces": [str(p.relative_to(ev.run_dir)) for _, _, _, p in ev.traces]}
    missing = ([not_judged] if not_judged else []) + ev.missing + skipped + list(model.missing)
    return Reconciliation(run_dir=ev.run_dir, run=run, rows=rows, missing=missing)


def run_steps(ev: RunEvidence) -> StepSelection:
    """Which steps measure steady-state time (ledger.evidence.steps), from every rank's step and timing records."""
    return select_steps(ev.config, ev.world_size, (s for r in ev.ranks.values() for s in r.steps),
                        (t.get("step") for r in ev.ranks.values() for t in r.timing))


def checked_summary(ev: RunEvidence, rank: int, summary: TraceSummary) -> TraceSummary:
    """Check that a trace belongs to this run: run id (written by our probes), rank, world size."""
    path = summary.path
    if summary.run_id is not None and summary.run_id != ev.manifest.get("run_id"):
        raise InputError(path, f"trace from another run: run_id {summary.run_id!r}, manifest says "
                               f"{ev.manifest.get('run_id')!r}")
    if summary.rank is not None and summary.rank != rank:
        raise InputError(path, f"distributedInfo says rank {summary.rank}, the file name rank {rank}")
    if summary.world_size is not None and summary.world_size != ev.world_size:
        raise InputError(path, f"trace from another run: world size {summary.world_size}, this run's is "
                               f"{ev.world_size}")
    return summary


def trace_rows(ev: RunEvidence, r: RankEvidence, summary: TraceSummary, selection: StepSelection,
               model: TimeModel) -> list[Row]:
    groups = rank_groups(ev.manifest, r.rank)
    summary = attribute_groups(summary, groups, ev.world_size, range_kinds(r.timing)).summary
    untraceable = untraceable_ops(rank_backend(ev.manifest, r.rank, summary.backend), summary)
    rows = volume_rows(ev.config, r, trace_volume(summary, groups, p2p_element_bytes(ev.config)), untraceable)
    rows += trace_overlap_rows(ev.config, r, summary, groups, selection,
                               **exposed_predictions(ev.config, model, r))
    return rows


# The time model prices a point-to-point transfer alone; the measured "pp" exposure also holds the wait for the
# peer stage (the bubble), judged by the pipeline rows, so it is not predicted here.
PREDICTED_EXPOSED_GROUPS = ("dp", "tp", "embedding")


def exposed_predictions(cfg: RunConfig | None, model: TimeModel, r: RankEvidence) -> dict[str, dict | None]:
    """The time model's exposed communication for one rank's overlap rows: per DP bucket (op, bucket index) and
    per group per step. Per bucket only with one model chunk: the measured rows number a rank's buckets per
    buffer, and later chunks' buckets would collide with the first chunk's."""
    if model.step is None or cfg is None or r.stage is None or r.stage >= len(model.step.stages):
        return {"predicted_exposed": None, "predicted_per_step": None}
    one_chunk = (cfg.parallel.virtual_pipeline_model_parallel_size or 1) == 1
    per_bucket = {(b.op, b.bucket): b.exposed for b in model.step.buckets if b.stage == r.stage} if one_chunk else None
    stage = model.step.stages[r.stage]
    return {"predicted_exposed": per_bucket,
            "predicted_per_step": {g: stage.exposed[g] for g in PREDICTED_EXPOSED_GROUPS if g in stage.exposed}}


def write(result: Reconciliation, out: Path | None = None) -> tuple[Path, Path]:
    """reconciliation.json and .csv into `out` (default RUN/ledger)."""
    out = out if out is not None else result.run_dir / LEDGER_DIR
    json_path, csv_path = out / JSON_NAME, out / CSV_NAME
    json_text = json.dumps(result.to_dict(), indent=1, default=str) + "\n"
    csv_text = to_csv(result.rows)
    atomic_write_text(json_path, json_text)
    atomic_write_text(csv_path, csv_text)
    return json_path, csv_path


def to_csv(rows: list[Row]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=FIELDS, lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow(r.to_dict())
    return buf.getvalue()
