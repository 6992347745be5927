"""The step decomposition as a waterfall (the dashboard's Traces page): per rank and profiled step, each term of
docs/formulas.md "Step decomposition" as a bar that starts where the term above it ended, so the last one ends at
the measured step (the terms add up to it), and the time model's twin of a term beside it when its row has a
prediction; the device-compute term's classes come with it, for a table beneath. Read from the reconciliation's
step.decomposition and step.device_compute rows; drawn as ledger.present.charts' SVG (no network, no script)."""
from __future__ import annotations

from typing import Any

from common.ops.compute_class import CLASSES
from ledger.present import units as fmt
from ledger.present.charts import Bar, Chart, Segment
from ledger.present.loaders import RunView, load_rows
from ledger.reconcile.step_decomposition import CLASS_METRIC, TERM_METRIC, class_of, term_of

MEASURED, PREDICTED, STEP = "#1e88e5", "#fb8c00", "#455a64"


def step_decompositions(view: RunView) -> list[dict[str, Any]]:
    """Per rank and profiled step (in that order), its terms as the rows give them: term, measured and predicted
    seconds (predicted None where the row has none); and its device compute's classes likewise, in CLASSES order
    (`classes`: class, measured, predicted, gap (relative), verdict)."""
    found: dict[tuple[int, int], list[dict[str, Any]]] = {}
    classes: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in load_rows(view):
        if r["metric"].startswith(TERM_METRIC):
            found.setdefault((r["rank"], r["step"]), []).append(
                {"term": term_of(r["metric"]), "measured": r["measured"], "predicted": r["predicted"]})
        elif r["metric"].startswith(CLASS_METRIC):
            classes.setdefault((r["rank"], r["step"]), []).append(
                {"class": class_of(r["metric"]), "measured": r["measured"], "predicted": r["predicted"],
                 "gap": r["rel_diff"], "verdict": r["verdict"]})
    return [{"rank": rank, "step": step, "terms": terms,
             "classes": sorted(classes.get((rank, step), []), key=lambda c: CLASSES.index(c["class"]))}
            for (rank, step), terms in sorted(found.items())]


def waterfall(decomposition: dict[str, Any]) -> Chart:
    """One decomposition's waterfall: a bar per term that took time or has a prediction (measured, then predicted
    beside it), then the step as the sum of each column."""
    bars: list[Bar] = []
    at = {"measured": 0.0, "predicted": 0.0}
    shown = [t for t in decomposition["terms"] if t["measured"] or t["predicted"]]
    for t in shown:
        for column, color in (("measured", MEASURED), ("predicted", PREDICTED)):
            value = t[column]
            if value is None:
                continue
            label = t["term"] if column == "measured" else f"{t['term']} (predicted)"
            bars.append(Bar(label, [Segment(at[column], value, color, f"{label}: {fmt.duration(value)} = "
                                                                       f"{fmt.exact(value, 's')}, from "
                                                                       f"{fmt.duration(at[column])}")]))
            at[column] += value
    predicted = any(t["predicted"] is not None for t in decomposition["terms"])
    for column in ("measured", "predicted") if predicted else ("measured",):
        label = "step, measured: the sum" if column == "measured" else "step, predicted: the sum"
        bars.append(Bar(label, [Segment(0.0, at[column], STEP, f"{label}: {fmt.duration(at[column])}")]))
    count = sum(t["predicted"] is not None for t in decomposition["terms"])
    return Chart(bars=bars, unit="s", x_title="time into the step", y_title="term",
                 legend=[(MEASURED, "measured term"), (PREDICTED, "predicted term (time model)"), (STEP, "the step")],
                 caption=(f"Rank {decomposition['rank']}, step {decomposition['step']}: each term starts where the "
                          f"one above ended, so the measured terms end at the ProfilerStep window's length, "
                          f"{fmt.duration(at['measured'])}; {count} of {len(decomposition['terms'])} terms predicted "
                          "(the rows' predicted column). Hover a bar for its exact figure."))
