"""The step decomposition's waterfall (ledger.present.step_waterfall), on the reconciliation of a real profiled H200
run (tests/fixtures/h200_2layer_profiled: steps 4-6 of rank 0): each measured term starts where the one above it
ended and the last ends at the ProfilerStep window, since the terms add up to it. Predicted bars are plumbing (no
row is predicted yet: the rows are given predictions here, and say so)."""
from __future__ import annotations

import re
from functools import lru_cache

import pytest

from ledger.present.charts import render
from ledger.present.loaders import RunView, open_run
from ledger.present.step_waterfall import MEASURED, PREDICTED, step_decompositions, waterfall
from tests.support.recorded_runs import FIXTURES


@lru_cache(maxsize=None)
def view() -> RunView:
    return open_run(FIXTURES / "h200_2layer_profiled")


def decompositions() -> list[dict]:
    return step_decompositions(view())


def replayed_windows() -> dict[tuple[int, int], float]:
    rows = view().reconciliation["rows"]
    return {(r["rank"], r["step"]): r["measured"] for r in rows if r["metric"] == "step.replay"}


def test_each_measured_term_starts_where_the_one_above_ended_and_the_last_ends_at_the_window():
    windows = replayed_windows()
    assert [(d["rank"], d["step"]) for d in decompositions()] == [(0, 4), (0, 5), (0, 6)]
    for d in decompositions():
        chart = waterfall(d)
        measured = [b for b in chart.bars if b.segments[0].color == MEASURED]
        terms = [b.segments[0] for b in measured]
        assert terms[0].start == 0
        assert all(a.start + a.length == pytest.approx(b.start) for a, b in zip(terms, terms[1:]))
        (total,) = [b.segments[0] for b in chart.bars if b.label == "step, measured: the sum"]
        assert total.start == 0 and total.length == pytest.approx(terms[-1].start + terms[-1].length)
        assert total.length == pytest.approx(windows[(d["rank"], d["step"])], abs=1e-6)
        assert [b.label for b in measured] == [t["term"] for t in d["terms"] if t["measured"]]


def test_a_predicted_term_is_drawn_beside_its_measurement_on_its_own_running_sum():
    """Plumbing: step 4's rows given predictions (device compute 25 ms, host-bound idle 5 ms)."""
    d = {**decompositions()[0], "terms": [dict(t) for t in decompositions()[0]["terms"]]}
    predicted = {"device compute": 0.025, "host-bound idle": 0.005}
    for t in d["terms"]:
        t["predicted"] = predicted.get(t["term"])
    bars = {b.label: b.segments[0] for b in waterfall(d).bars}
    assert (bars["device compute (predicted)"].start, bars["device compute (predicted)"].length) == (0.0, 0.025)
    assert (bars["host-bound idle (predicted)"].start, bars["host-bound idle (predicted)"].length) == (0.025, 0.005)
    assert bars["host-bound idle (predicted)"].color == PREDICTED
    assert bars["step, predicted: the sum"].length == pytest.approx(0.030)
    labels = [b.label for b in waterfall(d).bars]
    assert labels.index("device compute (predicted)") == labels.index("device compute") + 1


def test_the_chart_is_inline_svg_that_fetches_nothing():
    html = render(waterfall(decompositions()[0]))
    assert html.startswith("<figure><svg") and html.count("<rect") >= 4
    assert re.findall(r"https?://[^'\" ]+", html) == ["http://www.w3.org/2000/svg"]  # the namespace, never fetched
    assert "<script" not in html and " href=" not in html and " src=" not in html
