"""A run's evidence -> reconciliation rows and what is missing; written as RUN/ledger/reconciliation.json and .csv.

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
from common.run_dir import LEDGER_DIR, atomic_write_text
from ledger.evidence.rank_sets import RankChoice
from ledger.evidence.read import read_run
from ledger.evidence.run import RankEvidence, RunEvidence, cpu_sharing
from ledger.evidence.steps import StepSelection, run_steps
from ledger.evidence.trace_groups import attribute_groups, range_kinds
from ledger.evidence.traces import TraceSummary
from ledger.reconcile import hta, oversubscribed
from ledger.reconcile.checkpoint import checkpoint_rows
from ledger.reconcile.comm import (
    p2p_element_bytes,
    trace_volume,
    untraceable_ops,
    volume_rows,
)
from ledger.reconcile.expert_rows import expert_rows_rows
from ledger.reconcile.megatron_timers import timer_rows
from ledger.reconcile.memory import memory_rows
from ledger.reconcile.moe import moe_rows
from ledger.reconcile.overlap import overlap_rows, trace_overlap_rows
from ledger.reconcile.pipeline import pipeline_rows
from ledger.reconcile.rows import FIELDS, VERDICTS, Row
from ledger.reconcile.step_decomposition import StepDecomposition
from ledger.reconcile.throughput import throughput_rows
from ledger.reconcile.time_rows import (
    TimeModel,
    TimeSources,
    explain_step_time,
    predict_run,
    time_rows,
)
from ledger.reconcile.topology import groups_rows

JSON_NAME = "reconciliation.json"
CSV_NAME = "reconciliation.csv"
EAGER_FUSIONS = ("fusions not modelled: this run ran engine/jit.py's fusions eager (TRAIN_LEDGER_COMPILE=0), and the "
                 "formulas and the time model describe them compiled (one or two kernels each way): the eager chains' "
                 "extra kernels and launches (SwiGLU, RoPE, the cross-entropy passes; the run's own compute sweep "
                 "times them as they ran) and the loss's fp32 copies of the logits at the peak are not predicted")


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


@dataclass(frozen=True)
class TraceWork:
    """How a reconciliation reads the run's traces: worker processes (None: ledger.evidence.trace_pool decides),
    the HTA cross-check's ranks and budget, where progress lines go, and the ranks the step decomposition replays."""
    workers: int | None = None
    hta: hta.HtaChoice = hta.HtaChoice()
    progress: Callable[[str], None] = lambda _: None
    replay: RankChoice = RankChoice()


def reconcile(run_dir: str | Path, work: TraceWork = TraceWork(),
              sources: TimeSources = TimeSources()) -> Reconciliation:
    return reconcile_evidence(read_run(run_dir), work, sources)


def reconcile_evidence(ev: RunEvidence, work: TraceWork = TraceWork(),
                       sources: TimeSources = TimeSources()) -> Reconciliation:
    """The rows of a run's evidence (a caller that also needs the evidence itself reads the run once); `sources`:
    the time model's calibration beyond the run's own sweeps."""
    selection = run_steps(ev)
    model = predict_run(ev, sources)
    summaries = ev.trace_summaries(work.workers, work.progress)
    rows = groups_rows(ev) + memory_rows(ev) + pipeline_rows(ev, model, selection)
    for rank, r in sorted(ev.ranks.items()):
        rows += overlap_rows(ev.config, r, selection, rank in summaries, **exposed_predictions(ev.config, model, r))
    cross_check: dict[int, hta.CrossCheck] = {}
    decomposition = StepDecomposition(ev, model)
    for rank, summary in summaries.items():
        r = ev.rank_evidence(rank)
        rows += trace_rows(ev, r, summary, selection, model)
        decomposition.add(r, summary, next(t.path for t in ev.traces if t.rank == rank))
        cross_check[rank] = hta.cross_check_input(summary)
    decomposed, not_replayed = decomposition.rows(work.workers, work.replay, work.progress)
    rows += decomposed
    for rank, r in ev.ranks.items():
        if rank not in summaries:
            rows += volume_rows(ev.config, r, None)
    rows += throughput_rows(ev, selection, predicted_step_time=model.step.step_time if model.step else None)
    explain_step_time(rows, ev, model, selection)
    rows += time_rows(ev, model, selection)
    rows += timer_rows(ev, model, selection) if ev.framework == "megatron-lm" else []
    rows += moe_rows(ev, model, selection) + expert_rows_rows(ev, selection)
    rows += checkpoint_rows(ev)
    not_judged = oversubscribed.set_aside(rows, cpu_sharing(ev))
    check_rows, skipped = hta.hta_rows(cross_check, work.hta, work.workers, work.progress)
    rows += check_rows
    run = {"run_id": ev.run_id, "framework": ev.framework, "status": ev.manifest.get("status"),
           "world_size": ev.world_size, "ranks_with_events": sorted(ev.ranks),
           "traces": [str(t.path.relative_to(ev.run_dir)) for t in ev.traces]}
    missing = ([not_judged] if not_judged else []) + ev.missing + not_replayed + skipped + list(model.missing)
    missing += [EAGER_FUSIONS] if eager_fusions_on_gpu(ev) else []
    if sources.describe():
        missing.append(f"time model calibrated beyond the run's own sweeps by: {sources.describe()}")
    return Reconciliation(run_dir=ev.run_dir, run=run, rows=rows, missing=missing)


def eager_fusions_on_gpu(ev: RunEvidence) -> bool:
    """Whether the engine ran its compiled fusions eager on a GPU (on CPU they always run eager, as modelled)."""
    impl = ev.config.implementation if ev.config is not None else None
    return impl is not None and not impl.megatron and not impl.jit_fuser_compile and "cuda" in ev.device_types()


def trace_rows(ev: RunEvidence, r: RankEvidence, summary: TraceSummary, selection: StepSelection,
               model: TimeModel) -> list[Row]:
    groups = ev.groups(r.rank)
    summary = attribute_groups(summary, groups, ev.world_size, range_kinds(r.timing)).summary
    untraceable = untraceable_ops(ev.backend(r.rank, summary.backend), summary)
    rows = volume_rows(ev.config, r, trace_volume(summary, groups, p2p_element_bytes(ev.config)), untraceable)
    rows += trace_overlap_rows(ev.config, r, summary, groups, selection,
                               **exposed_predictions(ev.config, model, r))
    return rows


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
            "predicted_per_step": dict(stage.exposed)}


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
