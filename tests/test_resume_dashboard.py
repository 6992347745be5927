"""A run killed and resumed shows as one loss curve (ledger.present.dashboard_data.loss_curve, the Runs page): the
resumed run's own steps, preceded by the steps of the run that saved its checkpoint up to the iteration it resumed from,
with a marker there; the report names that run.

On real gloo runs: the first stops at --exit-interval 3 (saving, as a preempted job does) out of --train-iters 6,
the second resumes with --load into a new run directory (a run directory holds one run) and trains 4..6. The fixture
`resumed` (tests/conftest.py) makes them once per session: tests/test_resume_dashboard_browser.py reads them too.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from ledger.present import report
from ledger.present.dashboard_data import loss_curve
from ledger.present.loaders import open_run


def _logged_losses(run_dir: Path) -> dict[int, float]:
    lines = (run_dir / "ranks" / "rank0" / "events.jsonl").read_text().splitlines()
    return {r["step"]: r["loss"] for r in map(json.loads, lines) if r["kind"] == "step"}


@pytest.mark.slow
def test_the_resumed_run_continues_the_first_runs_curve(resumed):
    first, second = resumed
    assert sorted(_logged_losses(first)) == [1, 2, 3] and sorted(_logged_losses(second)) == [4, 5, 6]
    curve = loss_curve(open_run(second))
    assert [s["iteration"] for s in curve["steps"]] == [1, 2, 3, 4, 5, 6]
    assert [s["run"] for s in curve["steps"]] == [str(first)] * 3 + [str(second)] * 3
    logged = {**_logged_losses(first), **_logged_losses(second)}
    assert [s["loss"] for s in curve["steps"]] == [logged[i] for i in range(1, 7)]
    assert curve["resumes"] == [{"iteration": 3, "run": str(second), "from_run": str(first), "joined": True}]
    assert curve["notes"] == []
    assert loss_curve(open_run(first)) == {"steps": curve["steps"][:3], "resumes": [], "notes": []}


def _moved(run: Path, root: Path) -> Path:
    """A copy of `run` under `root` whose load event says the checkpoint was saved by /gone/first: as if the runs
    had been moved (or copied to another machine) since."""
    copy = root / run.name
    shutil.copytree(run, copy)
    events = copy / "ranks" / "rank0" / "events.jsonl"
    records = [json.loads(line) for line in events.read_text().splitlines()]
    for r in records:
        if r["kind"] == "checkpoint" and r["action"] == "load":
            r["saved_by_run_dir"] = "/gone/first"
    events.write_text("".join(json.dumps(r) + "\n" for r in records))
    return copy


@pytest.mark.slow
def test_moved_runs_are_still_joined_and_a_missing_one_is_named(resumed, tmp_path):
    """Runs moved together are found beside each other; a run whose earlier run is nowhere shows its own steps and
    says which run is missing."""
    first, second = resumed
    shutil.copytree(first, tmp_path / "moved" / "first")
    curve = loss_curve(open_run(_moved(second, tmp_path / "moved")))
    assert [s["iteration"] for s in curve["steps"]] == [1, 2, 3, 4, 5, 6]
    assert curve["resumes"][0]["from_run"] == str(tmp_path / "moved" / "first") and curve["notes"] == []
    alone = loss_curve(open_run(_moved(second, tmp_path / "alone")))
    assert [s["iteration"] for s in alone["steps"]] == [4, 5, 6]
    assert alone["resumes"] == [{"iteration": 3, "run": str(tmp_path / "alone" / "second"), "from_run": "/gone/first",
                                 "joined": False}]
    assert alone["notes"] == ["resumed from iteration 3; the run that saved it is not shown (/gone/first is not "
                              "there)"]


@pytest.mark.slow
def test_the_report_says_where_the_run_resumed_and_which_run_saved_it(resumed, tmp_path):
    first, second = resumed
    markdown, _ = report.write(str(second), out=tmp_path)  # not into the run: other tests read it as made
    assert (f"Resumed from the checkpoint of iteration 3: this run loaded {first.parent / 'ckpt' / 'iter_0000003'} "
            f"(saved by run {first}) at start and continued after it.") in " ".join(markdown.read_text().split())


@pytest.mark.slow
def test_the_runs_page_draws_one_curve_with_the_resume_marker(resumed, monkeypatch):
    pytest.importorskip("streamlit")
    from streamlit.testing.v1 import AppTest

    from dashboard import state
    from dashboard.launch import RUN_ENV, RUNS_ROOT_ENV

    first, second = resumed
    monkeypatch.setenv(RUNS_ROOT_ENV, str(second.parent))
    monkeypatch.delenv(RUN_ENV, raising=False)
    at = AppTest.from_file(str(Path(__file__).resolve().parents[1] / "dashboard" / "app.py"), default_timeout=120)
    at.run()
    at.session_state[state.SELECTED] = "second"
    at.switch_page("pages/runs.py").run()
    assert not at.exception and not at.error, [e.value for e in at.exception] + [e.value for e in at.error]
    (chart,) = [json.loads(e.proto.spec) for e in at.get("plotly_chart")
                if "resumed from iteration" in e.proto.spec]
    (line,) = chart["data"]
    assert line["x"] == [1, 2, 3, 4, 5, 6] and line["customdata"] == ["first"] * 3 + ["second"] * 3
    assert [a["text"] for a in chart["layout"]["annotations"]] == ["resumed from iteration 3"]
    assert [(s["x0"], s["x1"]) for s in chart["layout"]["shapes"]] == [(3, 3)]
    assert "iterations up to 3 from run first" in "\n".join(c.value for c in at.caption)
