"""Pipeline rows: the bubble each stage measured from its micro-batch timeline against the schedule's formula, and
how evenly forward and backward time spread over the stages.

Measured bubble of a stage in one step: 1 - busy / span, where busy is the union of the stage's forward / backward
ranges and span runs from the first forward to the last backward of the whole pipeline (all stages of the same
(tp, dp) column), on the timers' wall clock (`t_start` / `t_end`). That is the formula's "of wall time"
convention; idle / busy gives the "relative to compute" one. With equal micro-batch times every stage idles
(p - 1) slots, so every stage should match the textbook (p - 1) / (v m + p - 1), the figure users recognise, kept as
its own row and labelled so. The time model's bubble (ledger.models.time_model: the engine's schedule replayed with each
stage's own forward / backward times, P2P transfers and param all-gather waits) is what the measurement must match:
`pipeline.bubble_of_wall_time.model`, within BUBBLE_ABS_TOL (absolute), its explanation saying whether stage
imbalance or communication makes it differ from the textbook. The first step is left out when there are others: it
carries one-time work (allocator warm-up, Adam state creation).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from statistics import mean

from common.config import RunConfig
from common.events import COMPUTE_CATEGORIES
from common.intervals import length, union
from common.ops import Kernel
from ledger.evidence.run import RankEvidence, RunEvidence, after_first_step
from ledger.evidence.steps import StepSelection
from ledger.models.formulas.activations import recompute_label
from ledger.models.formulas.bubble import bubble
from ledger.models.formulas.params import num_chunks
from ledger.models.time_model.ops import RECOMPUTE, chunk_backward, chunk_forward, delayed_expert_wgrad
from ledger.reconcile.rows import Row, row
from ledger.reconcile.time_rows import TimeModel

BUBBLE_TOL = 0.3
BUBBLE_ABS_TOL = 0.03  # the model's bubble: 3 percentage points of the step
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
    return [StageSlot(rank=r.rank, stage=r.stage, step=t.step, kind=t.category,
                      microbatch=t.microbatch, chunk=t.chunk, start=t.t_start, end=t.t_end)
            for t in r.timing if t.category in COMPUTE_CATEGORIES and t.t_start is not None and t.t_end is not None]


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


def pipeline_rows(ev: RunEvidence, model: TimeModel | None = None,
                  selection: StepSelection | None = None) -> list[Row]:
    """`model`: the time model's predictions for the run (ledger.reconcile.time_rows.predict_run); `selection`: the
    steady steps (ledger.evidence.steps), else every step but the first. A step the profiler or a trace export
    disturbed on any rank stalls the whole pipeline, so it is left out of every rank's figures."""
    cfg = ev.config
    rows: list[Row] = []
    p = cfg.parallel.pipeline_model_parallel_size if cfg else None
    predicted = bubble(p, cfg.num_microbatches, cfg.parallel.virtual_pipeline_model_parallel_size or 1) \
        if cfg and p > 1 else None
    for column in pipeline_columns(ev).values():
        slots = [s for r in column for s in stage_slots(r)]
        if selection is None:
            slots = after_first_step(slots, lambda s: s.step)
        else:
            steps, _ = selection.timed({s.step for s in slots})
            slots = [s for s in slots if s.step in steps]
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
                                explanation=f"textbook (equal stages, no comm): idle / pipeline span; formula "
                                            f"(p-1)/(v m+p-1) with p={p} m={m} v={v}", **where))
                rows.append(model_bubble_row(model, r.stage, wall, predicted.of_wall_time, where))
                rows.append(row("pipeline.bubble_relative_to_compute", "stage",
                                predicted=predicted.relative_to_compute, measured=rel, unit="fraction",
                                tolerance=BUBBLE_TOL,
                                explanation=f"idle / busy; formula (p-1)/(v m) with p={p} m={m} v={v}", **where))
        rows += balance_rows(cfg, column, slots)
    return rows


def model_bubble_row(model: TimeModel | None, stage: int, measured: float, textbook: float,
                     where: dict) -> Row:
    """The time model's bubble of one stage, and which of stage imbalance or communication (P2P transfers, param
    all-gather waits) moves it off the textbook figure."""
    step = model.step if model is not None else None
    if step is None:
        why = "; ".join(model.missing) if model is not None and model.missing else "no time model"
        return row("pipeline.bubble_of_wall_time.model", "stage", measured=measured, unit="fraction", tolerance=0.0,
                   abs_tolerance=BUBBLE_ABS_TOL, explanation=f"time model, imbalance-aware: no prediction ({why})",
                   **where)
    st = step.stages[stage]
    imbalance, comm = st.bubble_without_comm - textbook, st.bubble - st.bubble_without_comm
    totals = [x.compute.forward + x.compute.backward for x in step.stages]
    shares = " / ".join(f"{t / mean(totals):.2f}" for t in totals)
    heavy = max(range(len(totals)), key=totals.__getitem__)
    terms = step.stages[heavy].compute.terms(True)
    term, seconds = max(((k, v) for k, v in terms.items() if k != "layers"), key=lambda kv: kv[1],
                        default=("layers", terms.get("layers", 0.0)))
    dominant = "stage imbalance" if abs(imbalance) >= abs(comm) else "communication"
    return row("pipeline.bubble_of_wall_time.model", "stage", predicted=st.bubble, measured=measured,
               unit="fraction", tolerance=0.0, abs_tolerance=BUBBLE_ABS_TOL,
               explanation=f"time model, imbalance-aware: busy {st.busy * 1e3:.3g} ms of a {step.span * 1e3:.3g} ms "
                           f"span; against the textbook {textbook:.3f}: stage imbalance {imbalance:+.3f} (stage time "
                           f"shares {shares}; stage {heavy} is {totals[heavy] / mean(totals):.2f}x the mean, its "
                           f"largest term beside its layers: {term} {seconds * 1e3:.3g} ms per forward), P2P "
                           f"transfers and param all-gather waits {comm:+.3f}: {dominant} dominates; within "
                           f"{BUBBLE_ABS_TOL:.0%} of the step (absolute)", **where)


def _flops(work, recomputed: bool = False) -> float:
    """The kernels' FLOPs among `work` (only the recompute's with `recomputed`)."""
    return sum(w.op.flops for w in work if isinstance(w.op, Kernel) and (not recomputed or w.term == RECOMPUTE))


def _forward_flops(cfg: RunConfig, stage: int) -> float:
    """A stage's forward FLOPs per micro-batch, all its chunks, from the time model's op lists."""
    return sum(_flops(chunk_forward(cfg, stage, c)) for c in range(num_chunks(cfg)))


def recomputed_share(cfg: RunConfig, stage: int) -> float:
    """The FLOPs a stage's backward re-runs of its forward (full recompute: each checkpointed group's forward;
    selective: core attention's) over its forward's FLOPs, per micro-batch, from the time model's op lists."""
    forward = _forward_flops(cfg, stage)
    rerun = sum(_flops(chunk_backward(cfg, stage, c), True) for c in range(num_chunks(cfg)))
    return rerun / forward if forward else 0.0


def delayed_share(cfg: RunConfig, stage: int) -> float:
    """The FLOPs per micro-batch of the weight gradients a stage's backward leaves to the step's end
    (--moe-delay-expert-wgrad: the experts') over its forward's FLOPs, from the time model's op lists."""
    forward = _forward_flops(cfg, stage)
    delayed = _flops(delayed_expert_wgrad(cfg, stage)) / cfg.num_microbatches
    return delayed / forward if forward else 0.0


def balance_rows(cfg: RunConfig | None, column: list[RankEvidence], slots: list[StageSlot]) -> list[Row]:
    """Mean forward and backward time per micro-batch on each stage, against the pipeline's mean and the 2x rule
    plus the forward the backward re-runs (docs/formulas.md, "Backward over forward")."""
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
        share = recomputed_share(cfg, stage) if cfg is not None else 0.0
        delayed = delayed_share(cfg, stage) if cfg is not None else 0.0
        mode = recompute_label(cfg.recompute) if cfg is not None else "none"
        rerun = (f", plus the forward it re-runs (recompute {mode}): {share:.1%} of the forward's FLOPs"
                 if mode != "none" else " (no recompute)")
        if delayed:
            rerun += (f", less the experts' weight gradients computed after the last backward "
                      f"(--moe-delay-expert-wgrad): {delayed:.1%} of the forward's FLOPs")
        rows.append(row("pipeline.backward_over_forward", "stage", predicted=BACKWARD_OVER_FORWARD + share - delayed,
                        measured=bwd / fwd if fwd else None, unit="ratio", tolerance=RATIO_TOL,
                        explanation=f"backward computes input and weight gradients: twice the forward's GEMM "
                                    f"FLOPs{rerun} (docs/formulas.md, \"Backward over forward\")", **where))
    return rows
