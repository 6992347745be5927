"""moe.expert_row_counts_new_per_step: how many of a rank's SequentialMLP row counts each steady step met for the
first time in the run.

An expert's GEMMs run at its routed rows; cuBLAS chooses a kernel on the host for each shape it has not met (a cache
keyed by shape), and at a count new to the process an expert costs the host ~0.3-0.65 ms more in forward and ~0.8 ms
in backward, the first few hundred counts of a process ~14 ms (BENCHMARKS.md, 2026-12-05 sixth), while at a seen
count its forward's host and device take about as long: so each new count idles the GPU. The time model prices every
micro-batch at T k / E rows an expert (uniform routing), every one met from the first step on: predicted 0 new counts
in a steady step. Measured from the step records' `moe_expert_rows` (the rows each expert's GEMMs ran in each
counted forward, padding included): per step, the distinct counts of the rank's experts not met in an earlier step of
the run (every layer's experts share their GEMMs' shapes), the median over the steady steps. Recorded by
SequentialMLP only: the grouped GEMMs' rows stay on the device, one kernel for every count.

Tolerance (docs/formulas.md, "Tolerances"): absolute, half a count (ok only when the median steady step meets none),
off beyond three halves: every new count is a host stall the time model does not price. A CPU rank's row is measured
only (n/a): its GEMMs choose no cuBLAS kernel.
"""
from __future__ import annotations

from pathlib import Path
from statistics import median

from common.errors import InputError
from common.events import StepRecord
from common.run_dir import events_path
from ledger.evidence.run import RankEvidence, RunEvidence
from ledger.evidence.steps import StepSelection
from ledger.reconcile.rows import Row, row

METRIC = "moe.expert_row_counts_new_per_step"
ABS_TOL = 0.5
PREDICTED = ("; predicted 0: the time model routes every micro-batch uniformly, T k / E rows an expert, met from the "
             "first step on; each new count costs cuBLAS a kernel choice on the host, which the time model does not "
             "price (BENCHMARKS.md, 2026-12-05 sixth: 0.3-0.65 ms an expert's forward on an H100's host)")
CPU_NOTE = "; not judged on a CPU rank: no cuBLAS, so a new row count costs no kernel choice"


def new_counts(rows_by_step: list[tuple[int, dict[str, list[list[int]]]]]) -> dict[int, int]:
    """step -> how many distinct row counts it met that no earlier step had (steps in the order given)."""
    met: set[int] = set()
    out = {}
    for step, layers in rows_by_step:
        counts = {n for forwards in layers.values() for forward in forwards for n in forward}
        out[step] = len(counts - met)
        met |= counts
    return out


def expert_rows(record: StepRecord, where: Path) -> dict[str, list[list[int]]]:
    """The record's moe_expert_rows; anything but {layer: [[non-negative ints] per forward]} is bad input."""
    try:
        out = {str(layer): [[int(n) for n in forward] for forward in forwards]
               for layer, forwards in record.moe_expert_rows.items()}
    except (AttributeError, TypeError, ValueError):
        out = None
    if out is None or any(n < 0 for forwards in out.values() for forward in forwards for n in forward):
        raise InputError(where, f"step {record.step}: moe_expert_rows is not {{layer: [[rows per expert] per "
                                "forward]} of non-negative counts")
    return out


def rank_row(r: RankEvidence, selection: StepSelection, where: Path, on_gpu: bool) -> Row | None:
    """The rank's row; on a CPU rank measured only (n/a): no cuBLAS, no kernel to choose."""
    recorded = sorted(((s.step, expert_rows(s, where)) for s in r.steps if s.moe_expert_rows and s.step is not None),
                      key=lambda found: found[0])
    if not recorded:
        return None
    per_step = new_counts(recorded)
    steady = list(selection.steady(per_step))
    if not steady:
        return None
    worst = max(steady, key=lambda s: per_step[s])
    first = recorded[0][0]
    measured = (f"SequentialMLP expert row counts first met in the step, median over {selection.counted(steady)}; "
                f"worst step {worst}: {per_step[worst]}, step {first}: {per_step[first]} (the rows each expert's GEMMs "
                "ran, from the step records' moe_expert_rows)")
    return row(METRIC, "rank", predicted=0.0 if on_gpu else None, measured=median(per_step[s] for s in steady),
               unit="counts", tolerance=0.0, abs_tolerance=ABS_TOL, rank=r.rank, stage=r.stage, source="events",
               explanation=measured + (PREDICTED if on_gpu else CPU_NOTE))


def expert_rows_rows(ev: RunEvidence, selection: StepSelection) -> list[Row]:
    return [found for rank, r in sorted(ev.ranks.items())
            if (found := rank_row(r, selection, events_path(ev.run_dir, rank), ev.runs_on_cuda(rank))) is not None]
