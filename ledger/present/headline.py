"""The headline: the few reconciled figures a reader checks first, one list shared by `train-ledger demo`, the report
and the dashboard's Runs page, so the three always show the same figures under the same names.

Each headline is a reconciliation metric and how its per-rank rows become one figure: "max" where the most loaded
rank is what matters (memory, exposed communication), "mean" where the ranks share one figure (bubble, throughput).
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import mean
from typing import Any

from common.wording import plural
from ledger.reconcile.rows import SEVERITY


@dataclass(frozen=True)
class Headline:
    label: str
    metric: str
    reduce: str  # "max" | "mean"


HEADLINES = (
    Headline("bytes/param", "memory.bytes_per_param", "max"),
    Headline("static memory after step 1", "memory.static_after_first_step", "max"),
    Headline("peak memory", "memory.peak_allocated", "max"),
    Headline("pipeline bubble", "pipeline.bubble_of_wall_time", "mean"),
    Headline("exposed DP comm / step", "overlap.exposed_dp_comm_per_step", "max"),
    Headline("tokens/s", "throughput.tokens_per_s", "mean"),
    Headline("FLOP/s per GPU", "throughput.tflops_per_gpu.megatron", "mean"),  # written in the unit its size needs
    Headline("MFU", "throughput.mfu.megatron", "mean"),
)


def rows_of(rows: list[dict[str, Any]], headline: Headline) -> list[dict[str, Any]]:
    return [r for r in rows if r["metric"] == headline.metric]


def best(row: dict[str, Any]) -> tuple[float | None, str]:
    """A row's most direct figure: measured, else the engine's inventory, else the prediction."""
    for column in ("measured", "inventory", "predicted"):
        if row.get(column) is not None:
            return row[column], column
    return None, ""


def figure(rows: list[dict[str, Any]], headline: Headline) -> dict[str, Any]:
    """One value for the headline ({value, unit, source}); value None when the run has no row for it (a CPU run
    has no MFU, a PP1 run no bubble)."""
    matching = rows_of(rows, headline)
    found = [(v, column) for v, column in map(best, matching) if v is not None]
    unit = matching[0]["unit"] if matching else ""
    if not found:
        return {"value": None, "unit": unit, "source": "no row"}
    values = [v for v, _ in found]
    value = max(values) if headline.reduce == "max" else mean(values)
    return {"value": value, "unit": unit,
            "source": f"{headline.reduce} over {plural(len(values), 'row')}, {found[0][1]}"}


def figures(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {h.label: figure(rows, h) for h in HEADLINES}


def verdict(rows: list[dict[str, Any]]) -> str:
    """The worst verdict of the rows that have one; "n/a" when none can be judged (a figure nobody predicts, or one
    that agrees with its reference by construction: "identity")."""
    judged = [r["verdict"] for r in rows if r["verdict"] not in ("n/a", "identity")]
    return max(judged, key=SEVERITY.__getitem__) if judged else "n/a"
