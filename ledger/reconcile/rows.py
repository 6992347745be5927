"""One reconciled figure: the formula's prediction, the engine's inventory and the measurement, side by side.

The verdict compares the measurement against the best available reference (the prediction, else the inventory);
without a measurement it compares the inventory against the prediction, which is still worth doing on a CPU run
(the formula and the engine were derived independently). A row with fewer than two columns has verdict "n/a": it
is a term that explains another figure (fragmentation, non-PyTorch memory) or a figure nobody predicts; when it is
n/a only because the time model gave it no figure, its explanation says so and why that can be (NO_TIME_MODEL).

Verdict "identity" marks a row whose reference is built from its own measurement (or from the same config as the
measurement): it agrees by construction, so it is shown for reading, never counted as "ok" and never fails a gate.
Tolerances are relative (`tolerance`) with an optional absolute floor (`abs_tolerance`, in the row's unit) for
figures whose size is near their noise (a few ms of exposed communication); docs/formulas.md "Tolerances" lists
each row type's and why.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable

VERDICTS = ("ok", "warn", "off", "n/a", "identity")
SEVERITY = {"n/a": 0, "identity": 0, "ok": 0, "warn": 1, "off": 2}
# A gap up to `tolerance` is ok, up to WARN_FACTOR x tolerance a warning, beyond that off.
WARN_FACTOR = 3.0
NOT_ON_CPU = "not measured on CPU (no CUDA memory_stats / NVML)"
NO_TIME_MODEL = ("no prediction: the time model (ledger.models.time_model) gave none (it needs --compute-sweep and "
                 "--bandwidth-sweep; it prices a synchronous all-gather inside the optimizer step, not per bucket, "
                 "and per-bucket figures only with one model chunk)")


@dataclass
class Row:
    metric: str
    scope: str  # "rank" | "stage" | "bucket" | "run"
    predicted: float | None
    inventory: float | None
    measured: float | None
    unit: str
    tolerance: float  # relative
    explanation: str
    rank: int | None = None
    stage: int | None = None
    bucket: int | None = None
    step: int | None = None
    diff: float | None = None
    rel_diff: float | None = None
    verdict: str = "n/a"
    source: str = ""  # where the measurement came from: "events", "trace", "tensorboard", "hta"
    abs_tolerance: float = 0.0  # in `unit`: a gap this small is ok whatever its relative size

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELDS = [f.name for f in dataclasses.fields(Row)]


def judge(actual: float, reference: float, tolerance: float,
          abs_tolerance: float = 0.0) -> tuple[float, float | None, str]:
    """(diff, rel_diff, verdict) of `actual` against `reference`: ok within the relative tolerance or within the
    absolute one, warn within WARN_FACTOR times either, off beyond."""
    diff = actual - reference
    rel = diff / abs(reference) if reference != 0 else (0.0 if diff == 0 else None)
    for factor, verdict in ((1.0, "ok"), (WARN_FACTOR, "warn")):
        if abs(diff) <= abs_tolerance * factor or (rel is not None and abs(rel) <= tolerance * factor):
            return diff, rel, verdict
    return diff, rel, "off"


def row(metric: str, scope: str, *, predicted: float | None = None, inventory: float | None = None,
        measured: float | None = None, unit: str, tolerance: float, explanation: str, abs_tolerance: float = 0.0,
        **where: Any) -> Row:
    """Build a row and its verdict from whichever columns exist."""
    r = Row(metric=metric, scope=scope, predicted=predicted, inventory=inventory, measured=measured, unit=unit,
            tolerance=tolerance, explanation=explanation, abs_tolerance=abs_tolerance, **where)
    reference = predicted if predicted is not None else inventory
    actual = measured if measured is not None else (inventory if predicted is not None else None)
    if actual is not None and reference is not None:
        r.diff, r.rel_diff, r.verdict = judge(actual, reference, tolerance, abs_tolerance)
    return r


def predicted_row(metric: str, scope: str, *, predicted: float | None, measured: float | None, unit: str,
                  tolerance: float, explanation: str, abs_tolerance: float = 0.0, **where: Any) -> Row:
    """A measurement judged against a prediction another model supplies (the time model): without one the row is
    n/a and says that the prediction is missing, rather than looking like a figure nobody could predict."""
    if predicted is None and measured is not None:
        explanation = f"{explanation}; {NO_TIME_MODEL}"
    return row(metric, scope, predicted=predicted, measured=measured, unit=unit, tolerance=tolerance,
               explanation=explanation, abs_tolerance=abs_tolerance, **where)


def upper_bound_row(metric: str, scope: str, *, predicted: float | None, measured: float | None, unit: str,
                    tolerance: float, explanation: str, abs_tolerance: float = 0.0,
                    judged_elsewhere: str | None = None, **where: Any) -> Row:
    """A measurement that bounds the true figure from above (an async collective timed from issue to wait returned
    also spans the time it waited to be waited on). A bound below the prediction beyond the tolerance is off: the
    true figure is lower still, so the prediction is too high. Within the tolerance it is ok. Above, it cannot tell
    a slow collective from a late wait: verdict n/a, saying so and naming the row that does judge the figure
    (`judged_elsewhere`)."""
    r = row(metric, scope, predicted=predicted, measured=measured, unit=unit, tolerance=tolerance,
            explanation=explanation, abs_tolerance=abs_tolerance, **where)
    if r.diff is None or r.verdict == "ok":
        return r
    if r.diff < 0:  # how far, the row's gap column says: the clause is the same for every row, a report's note
        r.verdict = "off"
        r.explanation += "; the upper bound lies below the prediction: the true figure is lower still"
    else:
        r.verdict = "n/a"
        r.explanation += ("; the bound lies above the prediction and cannot tell a slower collective from a wait "
                          "that came late (compute between issue and wait)"
                          + (f": {judged_elsewhere} judges it" if judged_elsewhere else ": no trace judges it"))
    return r


def at_most_row(metric: str, scope: str, *, reference: float, measured: float, unit: str, tolerance: float,
                explanation: str, **where: Any) -> Row:
    """A figure that may fall below its reference but must not exceed it (a rank's step time against the other
    ranks': a faster rank is no straggler). Above: judged as `row`; at or below: ok."""
    r = row(metric, scope, predicted=reference, measured=measured, unit=unit, tolerance=tolerance,
            explanation=explanation, **where)
    if r.diff is not None and r.diff <= 0:
        r.verdict = "ok"
    return r


def identity_row(metric: str, scope: str, *, measured: float | None, unit: str, explanation: str,
                 **where: Any) -> Row:
    """A figure whose only reference would be built from itself or from the config that also produced it: shown
    with verdict "identity", which no count of agreement includes and no gate reaches."""
    return Row(metric=metric, scope=scope, predicted=None, inventory=None, measured=measured, unit=unit,
               tolerance=0.0, explanation=explanation, verdict="identity", **where)


def threshold_row(metric: str, scope: str, *, measured: float, warn_at: float, off_at: float, unit: str,
                  explanation: str, **where: Any) -> Row:
    """A measured-only figure judged against fixed limits (retries, OOMs, stragglers, fragmentation)."""
    verdict = "off" if measured >= off_at else "warn" if measured >= warn_at else "ok"
    return Row(metric=metric, scope=scope, predicted=None, inventory=None, measured=measured, unit=unit,
               tolerance=warn_at, explanation=explanation, verdict=verdict, **where)


def worst(rows: Iterable[Row]) -> str:
    found = "ok"
    for r in rows:
        if SEVERITY[r.verdict] > SEVERITY[found]:
            found = r.verdict
    return found


def reaches(rows: Iterable[Row], level: str) -> bool:
    """True when some row's verdict is at least `level` ("warn" or "off")."""
    return any(SEVERITY[r.verdict] >= SEVERITY[level] for r in rows)
