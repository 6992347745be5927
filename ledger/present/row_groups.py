"""Reconciliation rows grouped for reading: one line per figure instead of one per rank.

The reconciliation has a row per metric and rank (and bucket, and measurement source); on an 8-rank run most of them
say the same thing eight times. A reader wants each figure once, with the range it takes over the ranks, the worst
verdict and the rank that has it. So rows are grouped by (metric family, bucket, source): the ranks of a line are
the ranks whose row it stands for, every column is the range over them (ledger.present.units.span), and the explanation
is the worst row's (the one a reader must act on). The full per-rank table stays in reconciliation.csv / .json.

A metric and its time-model twin (`X` and `X.model`, e.g. the textbook bubble and the imbalance-aware one) share one
line: the textbook formula, the time model and the measurement side by side, each prediction with its own verdict.

Which column a prediction belongs in follows from what made it (`predictor`): the closed-form formulas of
ledger.models.formulas, the calibrated time model (ledger.models.time_model and the bandwidth sweep), or another
measurement used as a reference (the other ranks' step time, the ledger's own trace reading that HTA checks).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ledger.evidence.steps import step_list
from ledger.present import units as fmt
from ledger.reconcile.rows import SEVERITY

MODEL_SUFFIX = ".model"
FORMULA, TIME_MODEL, REFERENCE = "formula", "time model", "reference"
PREDICTORS = (FORMULA, TIME_MODEL, REFERENCE)
REFERENCE_METRICS = ("throughput.step_time_vs_other_ranks", "overlap.hta_comm_comp_overlap")


def predictor(metric: str) -> str:
    """What predicts `metric`: the time model (time.*, X.model, the step time, the step decomposition's terms,
    exposed and comm time of collectives), another measurement (REFERENCE_METRICS) or a formula (everything else)."""
    if metric in REFERENCE_METRICS:
        return REFERENCE
    if (metric.startswith(("time.", "step.decomposition.", "step.device_compute.")) or metric.endswith(MODEL_SUFFIX)
            or metric == "throughput.step_time"
            or metric.startswith("overlap.") and ("exposed" in metric or metric.endswith("comm_time"))):
        return TIME_MODEL
    return FORMULA


def worst_row(rows: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The row a reader must act on: the most severe verdict, then the largest relative gap; None when no row is
    judged warn or off (then no rank is worse than another)."""
    judged = [r for r in rows if SEVERITY.get(r["verdict"], 0) > 0]
    if not judged:
        return None
    return max(judged, key=lambda r: (SEVERITY[r["verdict"]], abs(r["rel_diff"] or 0.0), -(r["rank"] or 0)))


def verdict_of(rows: list[dict[str, Any]]) -> str:
    """The worst verdict; "n/a" or "identity" only when every row is."""
    found = [r["verdict"] for r in rows]
    if not found:
        return "n/a"
    judged = [v for v in found if SEVERITY.get(v, 0) > 0 or v == "ok"]
    if judged:
        return max(judged, key=SEVERITY.__getitem__)
    return "identity" if all(v == "identity" for v in found) else "n/a"


@dataclass
class Judgement:
    """One prediction's verdict over a line's rows: the worst, and how many of the rows have it."""
    label: str  # "" for a line with one prediction, else the predictor
    verdict: str
    count: int
    total: int

    def text(self) -> str:
        share = f" {self.count}/{self.total}" if self.total > 1 and self.count < self.total else ""
        return (f"{self.label} " if self.label else "") + self.verdict + share


@dataclass
class Line:
    """One figure of the report: the rows of one metric (and bucket and source) over the ranks, and the rows of
    its time-model twin when it has one."""
    metric: str
    rows: list[dict[str, Any]]
    model: list[dict[str, Any]] = field(default_factory=list)

    @property
    def unit(self) -> str:
        return self.rows[0]["unit"]

    @property
    def ranks(self) -> list[int]:
        return sorted({r["rank"] for r in self.rows + self.model if r["rank"] is not None})

    def all_rows(self) -> list[dict[str, Any]]:
        return self.rows + self.model

    def where(self) -> str:
        """'ranks 0–7 · stage 1 · bucket 0 · steps 4-6 · timers': what the line stands for (a line of per-step
        rows names every step it holds, as it names every rank)."""
        first = self.rows[0]
        parts = [f"rank{'s' if len(self.ranks) > 1 else ''} {fmt.ranks(self.ranks)}" if self.ranks else "run"]
        stages = {r["stage"] for r in self.rows if r["stage"] is not None}
        if len(stages) == 1 and self.ranks:
            parts.append(f"stage {stages.pop()}")
        if first.get("bucket") is not None:
            parts.append(f"bucket {first['bucket']}")
        steps = {r["step"] for r in self.all_rows() if r.get("step") is not None}
        if steps:
            parts.append(step_list(steps))  # in the words every explanation uses for steps
        if first.get("source"):
            parts.append(first["source"])
        return " · ".join(parts)

    def predictions(self) -> dict[str, list[float | None]]:
        """Predicted values by predictor (formula / time model / reference), for the columns that have any."""
        out: dict[str, list[float | None]] = {}
        for rows in (self.rows, self.model):
            if rows:
                out.setdefault(predictor(rows[0]["metric"]), []).extend(r["predicted"] for r in rows)
        return {k: v for k, v in out.items() if any(x is not None for x in v)}

    def cells(self) -> dict[str, str]:
        """Every column as the range over the line's ranks: formula, time model, reference, inventory, measured."""
        predicted = self.predictions()
        cells = {name: fmt.span(predicted.get(name, []), self.unit) for name in PREDICTORS}
        cells["inventory"] = fmt.span((r["inventory"] for r in self.rows), self.unit)
        cells["measured"] = fmt.span((r["measured"] for r in self.rows), self.unit)
        return cells

    def judgements(self) -> list[Judgement]:
        """The verdict of each prediction: one for a plain line, the time model's then the formula's for a twin."""
        groups = [(self.model, TIME_MODEL), (self.rows, FORMULA)] if self.model else [(self.rows, "")]
        out = []
        for rows, label in groups:
            verdict = verdict_of(rows)
            out.append(Judgement(label, verdict, sum(r["verdict"] == verdict for r in rows), len(rows)))
        return out

    def verdict(self) -> str:
        return verdict_of(self.all_rows())

    def worst(self) -> dict[str, Any] | None:
        return worst_row(self.model) or worst_row(self.rows)

    def gap(self) -> str:
        """The worst row's relative gap to its reference, signed, with its rank when the line has several."""
        row = self.worst()
        if row is None or row["rel_diff"] is None:
            return fmt.DASH
        where = f" (rank {row['rank']})" if row["rank"] is not None and len(self.ranks) > 1 else ""
        return fmt.percent(row["rel_diff"], signed=True) + where

    def explanation(self) -> str:
        """The worst row's explanation (the first row's when none is judged worse); for a twin, the time model's
        then the formula's."""
        parts = []
        for rows in (self.model, self.rows):
            if rows:
                parts.append((worst_row(rows) or rows[0])["explanation"])
        return "; ".join(parts)


def family(metric: str) -> str:
    """`X.model` belongs to X's line."""
    return metric[: -len(MODEL_SUFFIX)] if metric.endswith(MODEL_SUFFIX) else metric


def group(rows: list[dict[str, Any]]) -> list[Line]:
    """Lines in the order their first row appears; a twin's `.model` rows join the line of its textbook rows."""
    lines: dict[tuple[str, Any, str], Line] = {}
    for r in rows:
        key = (family(r["metric"]), r.get("bucket"), r.get("source") or "")
        line = lines.get(key)
        if line is None:
            line = lines[key] = Line(metric=key[0], rows=[])
        (line.model if r["metric"].endswith(MODEL_SUFFIX) else line.rows).append(r)
    for line in lines.values():
        if not line.rows:  # a time-model row with no textbook twin stands alone
            line.rows, line.model = line.model, []
            line.metric = line.rows[0]["metric"]
    return list(lines.values())
