"""One reconciled figure: the formula's prediction, the engine's inventory and the measurement, side by side.

The verdict compares the measurement against the best available reference (the prediction, else the inventory);
without a measurement it compares the inventory against the prediction, which is still worth doing on a CPU run
(the formula and the engine were derived independently). A row with fewer than two columns has verdict "n/a": it
is a term that explains another figure (fragmentation, non-PyTorch memory) or a figure nobody predicts.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable

VERDICTS = ("ok", "warn", "off", "n/a")
SEVERITY = {"n/a": 0, "ok": 0, "warn": 1, "off": 2}
# A gap up to `tolerance` is ok, up to WARN_FACTOR x tolerance a warning, beyond that off.
WARN_FACTOR = 3.0
NOT_ON_CPU = "not measured on CPU (no CUDA memory_stats / NVML)"


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

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


FIELDS = [f.name for f in dataclasses.fields(Row)]


def judge(actual: float, reference: float, tolerance: float) -> tuple[float, float | None, str]:
    """(diff, rel_diff, verdict) of `actual` against `reference` under a relative tolerance."""
    diff = actual - reference
    if reference == 0:
        rel = 0.0 if diff == 0 else None
        verdict = "ok" if diff == 0 else "off"
        return diff, rel, verdict
    rel = diff / abs(reference)
    if abs(rel) <= tolerance:
        return diff, rel, "ok"
    return diff, rel, "warn" if abs(rel) <= tolerance * WARN_FACTOR else "off"


def row(metric: str, scope: str, *, predicted: float | None = None, inventory: float | None = None,
        measured: float | None = None, unit: str, tolerance: float, explanation: str, **where: Any) -> Row:
    """Build a row and its verdict from whichever columns exist."""
    r = Row(metric=metric, scope=scope, predicted=predicted, inventory=inventory, measured=measured, unit=unit,
            tolerance=tolerance, explanation=explanation, **where)
    reference = predicted if predicted is not None else inventory
    actual = measured if measured is not None else (inventory if predicted is not None else None)
    if actual is not None and reference is not None:
        r.diff, r.rel_diff, r.verdict = judge(actual, reference, tolerance)
    return r


def upper_bound_row(metric: str, scope: str, *, predicted: float | None, measured: float | None, unit: str,
                    tolerance: float, explanation: str, **where: Any) -> Row:
    """A measurement that bounds the true figure from above (an async collective timed from issue to wait returned
    spans whatever compute ran before the wait). Below the prediction it is judged as usual: the true figure is
    lower still. Above it beyond the tolerance it neither confirms nor refutes the prediction: verdict n/a."""
    r = row(metric, scope, predicted=predicted, measured=measured, unit=unit, tolerance=tolerance,
            explanation=explanation, **where)
    if r.rel_diff is not None and r.rel_diff > tolerance:
        r.verdict = "n/a"
        r.explanation += "; the bound lies above the prediction, so it does not test it"
    return r


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
