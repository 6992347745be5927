"""time.data_wait_per_step: how long a rank's training loop waited for its next micro-batch, per step.

Expected 0: the engine's loader builds the micro-batches ahead on a background thread (docs/engine.md, "Data"),
so `next()` finds each one ready. Measured from each rank's step records' `data_wait_s` (the seconds
`next()` blocked on the loader's queue, summed over the step's micro-batches; only ranks that read data, the first
and last pipeline stages, carry it). Per rank, the mean over the steady steps (ledger.evidence.steps: the run's
first step waits for the loader's first batch by design, and the profiler's steps are slowed as a whole), i.e. what
the waits cost the run's throughput; the worst step is named in the explanation.

Tolerance (docs/formulas.md, "Data wait"): absolute, the larger of 1% of the rank's median step time (a loader that
costs more than that breaks the goal of real data within 1% of mock data's tokens/s) and 1 ms (on a step of a few
ms, 1% is tens of microseconds: the hand-off itself, a lock per micro-batch, and, when the producer was late by a
hair, the operating system's wake-up of the blocked loop, which waits for a core). Beyond 3x the tolerance: off.
"""
from __future__ import annotations

from statistics import mean, median

from ledger.evidence.run import RankEvidence, RunEvidence
from ledger.evidence.steps import StepSelection
from ledger.reconcile.rows import Row, row

STEP_SHARE = 0.01  # of the rank's median step time
FLOOR_S = 1e-3


def tolerance_s(step_time_s: float) -> float:
    return max(FLOOR_S, STEP_SHARE * step_time_s)


def rank_row(r: RankEvidence, selection: StepSelection) -> Row | None:
    records = [s for s in r.steps if s.data_wait_s is not None and s.step is not None]
    steady = set(selection.steady(s.step for s in records))
    kept = [s for s in records if s.step in steady]
    if not kept:
        return None
    waits = [s.data_wait_s or 0.0 for s in kept]
    step_time = median(s.step_time_s or 0.0 for s in kept)
    worst = max(kept, key=lambda s: s.data_wait_s or 0.0)
    floor = tolerance_s(step_time)
    return row("time.data_wait_per_step", "rank", predicted=0.0, measured=mean(waits), unit="s", tolerance=0.0,
               abs_tolerance=floor, rank=r.rank, stage=r.stage, source="events",
               explanation=(f"the seconds next() blocked on the background data loader per step, mean over "
                            f"{selection.counted(s.step for s in kept)}; worst step {worst.step}: "
                            f"{(worst.data_wait_s or 0.0) * 1e3:.3g} ms; expected 0 (the loader builds ahead), allowed "
                            f"{floor * 1e3:.3g} ms: max(1 ms, 1% of the median step {step_time * 1e3:.3g} ms)"))


def data_wait_rows(ev: RunEvidence, selection: StepSelection) -> list[Row]:
    return [found for _, r in sorted(ev.ranks.items()) if (found := rank_row(r, selection)) is not None]
