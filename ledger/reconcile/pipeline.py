"""Pipeline rows: the bubble each stage measured from its micro-batch timeline against the schedule's formula, and
how evenly forward and backward time spread over the stages.

Measured bubble of a stage in one step: 1 - busy / span, where busy is the union of the stage's forward / backward
ranges and span runs from the first forward to the last backward of the whole pipeline (all stages of the same
(tp, dp) column), on the timers' wall clock (`t_start` / `t_end`). That is the formula's "of wall time"
convention; idle / busy gives the "relative to compute" one. With equal micro-batch times every stage idles
(p - 1) slots, so every stage should match (p - 1) / (v m + p - 1). The first step is left out when there are
others: it carries one-time work (allocator warm-up, Adam state creation).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from statistics import mean

from ledger.formulas.bubble import bubble
from ledger.reconcile.evidence import RankEvidence, RunEvidence, after_first_step
from ledger.reconcile.intervals import length, union
from ledger.reconcile.rows import Row, row

BUBBLE_TOL = 0.3
BALANCE_TOL = 0.1
BACKWARD_OVER_FORWARD = 2.0  # backward does two GEMMs (input and weight grads) per forward GEMM
RATIO_TOL = 0.25


@dataclass
class StageSlot:
    """One forward or backward range of one micro-batch on one stage: a bar of the pipeline timeline."""
    rank: int
    stage: int
    step: int
    kind: str  # "forward" | "backward"
    microbatch: int | None
    chunk: int | None
    start: float
    end: float


def stage_slots(r: RankEvidence) -> list[StageSlot]:
    return [StageSlot(rank=r.rank, stage=r.stage, step=t.get("step"), kind=t["category"],
                      microbatch=t.get("microbatch"), chunk=t.get("chunk"), start=t["t_start"], end=t["t_end"])
            for t in r.timing if t.get("category") in ("forward", "backward") and "t_start" in t]


def measured_bubbles(slots: list[StageSlot]) -> dict[int, list[tuple[float, float]]]:
    """Per rank: one (of_wall_time, relative_to_compute) pair per step, within the rank's pipeline span."""
    by_step: dict[int, list[StageSlot]] = defaultdict(list)
    for s in slots:
        by_step[s.step].append(s)
    steps = sorted(by_step)
    out: dict[int, list[tuple[float, float]]] = defaultdict(list)
    for step in steps:
        span = (min(s.start for s in by_step[step]), max(s.end for s in by_step[step]))
        per_rank: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for s in by_step[step]:
            per_rank[s.rank].append((s.start, s.end))
        for rank, ranges in per_rank.items():
            busy = length(union(ranges))
            idle = (span[1] - span[0]) - busy
            out[rank].append((idle / (span[1] - span[0]), idle / busy if busy else 0.0))
    return out


def pipeline_columns(ev: RunEvidence) -> dict[tuple[int, int], list[RankEvidence]]:
    """Ranks grouped by (tp, dp): each group is one pipeline, its stages in order."""
    columns: dict[tuple[int, int], list[RankEvidence]] = defaultdict(list)
    for r in ev.ranks.values():
        columns[(r.coords.get("tp", 0), r.coords.get("dp", 0))].append(r)
    return columns


def pipeline_rows(ev: RunEvidence) -> list[Row]:
    cfg = ev.config
    rows: list[Row] = []
    p = cfg.parallel.pipeline_model_parallel_size if cfg else None
    predicted = bubble(p, cfg.num_microbatches, cfg.parallel.virtual_pipeline_model_parallel_size or 1) \
        if cfg and p > 1 else None
    for column in pipeline_columns(ev).values():
        slots = after_first_step([s for r in column for s in stage_slots(r)], lambda s: s.step)
        if not slots:
            continue
        bubbles = measured_bubbles(slots) if p and p > 1 else {}
        for r in sorted(column, key=lambda r: r.stage):
            where = dict(rank=r.rank, stage=r.stage, source="timers")
            if r.rank in bubbles:
                wall = mean(b[0] for b in bubbles[r.rank])
                rel = mean(b[1] for b in bubbles[r.rank])
                m, v = cfg.num_microbatches, cfg.parallel.virtual_pipeline_model_parallel_size or 1
                rows.append(row("pipeline.bubble_of_wall_time", "stage", predicted=predicted.of_wall_time,
                                measured=wall, unit="fraction", tolerance=BUBBLE_TOL,
                                explanation=f"idle / pipeline span; formula (p-1)/(v m+p-1) with p={p} m={m} v={v}",
                                **where))
                rows.append(row("pipeline.bubble_relative_to_compute", "stage",
                                predicted=predicted.relative_to_compute, measured=rel, unit="fraction",
                                tolerance=BUBBLE_TOL,
                                explanation=f"idle / busy; formula (p-1)/(v m) with p={p} m={m} v={v}", **where))
        rows += balance_rows(column, slots)
    return rows


def balance_rows(column: list[RankEvidence], slots: list[StageSlot]) -> list[Row]:
    """Mean forward and backward time per micro-batch on each stage, against the pipeline's mean and the 2x rule."""
    per_stage: dict[int, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    rank_of: dict[int, int] = {r.stage: r.rank for r in column}
    for s in slots:
        per_stage[s.stage][s.kind].append(s.end - s.start)
    totals = {st: mean(k["forward"]) + mean(k["backward"]) for st, k in per_stage.items()
              if k["forward"] and k["backward"]}
    rows = []
    if not totals:
        return rows
    average = mean(totals.values())
    for stage, total in sorted(totals.items()):
        where = dict(rank=rank_of[stage], stage=stage, source="timers")
        fwd, bwd = mean(per_stage[stage]["forward"]), mean(per_stage[stage]["backward"])
        if len(totals) > 1:
            rows.append(row("pipeline.stage_time_share", "stage", predicted=1.0, measured=total / average,
                            unit="x mean", tolerance=BALANCE_TOL,
                            explanation=f"forward {fwd * 1e3:.2f} ms + backward {bwd * 1e3:.2f} ms per micro-batch "
                                        "against the mean over stages (embedding / output layer make the ends "
                                        "heavier)", **where))
        rows.append(row("pipeline.backward_over_forward", "stage", predicted=BACKWARD_OVER_FORWARD,
                        measured=bwd / fwd if fwd else None, unit="ratio", tolerance=RATIO_TOL,
                        explanation="backward computes input and weight gradients: about twice the forward FLOPs",
                        **where))
    return rows
