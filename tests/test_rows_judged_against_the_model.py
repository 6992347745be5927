"""The time model's bubble and exposed communication are judged against the model, never against the measurement
they judge, and a measurement far from its prediction is off.

Recorded runs (tests/fixtures, READMEs there and in tests/test_reconcile_fixtures.py): gloo_pp2_sweeps (PP2, both
sweeps, so the model predicts each stage's bubble and the embedding group's exposed time) and gloo_dp2_sweeps (DP2,
both sweeps: the DP group's exposed time). Each test's docstring names the mutation of the ledger it catches; each was
applied by hand and seen to fail the test before it was reverted.
"""
from __future__ import annotations

import shutil
from functools import lru_cache
from pathlib import Path

import pytest

from common.events import COMPUTE_CATEGORIES
from ledger.evidence.read import read_run
from ledger.reconcile.pipeline import BUBBLE_ABS_TOL, model_bubble_row
from ledger.reconcile.rows import WARN_FACTOR
from ledger.reconcile.run import Reconciliation
from ledger.reconcile.time_rows import TimeModel, predict_run
from tests.support.recorded_runs import FIXTURES, only, reconcile_recorded
from tests.support.records import rewrite_events, stretch_range

PP2, DP2 = "gloo_pp2_sweeps", "gloo_dp2_sweeps"
MODEL_BUBBLE = "pipeline.bubble_of_wall_time.model"


@lru_cache(maxsize=None)
def model(fixture: str) -> TimeModel:
    return predict_run(read_run(FIXTURES / fixture))


@pytest.fixture(scope="module")
def reconciled(tmp_path_factory) -> dict[str, Reconciliation]:
    root = tmp_path_factory.mktemp("judged")
    return {name: reconcile_recorded(shutil.copytree(FIXTURES / name, root / name)) for name in (PP2, DP2)}


def shrunk_compute(src: Path, dst: Path, rank: int, factor: float) -> Path:
    """A copy of `src` whose rank `rank` took `factor` of each forward / backward range's measured time: each range
    keeps its start, and every field that says when it ended moves (end_s, t_end, duration_s)."""
    shutil.copytree(src, dst)

    def edit(e: dict) -> None:
        if e["kind"] == "timing" and e["category"] in COMPUTE_CATEGORIES:
            stretch_range(e, factor)

    rewrite_events(dst / "ranks" / f"rank{rank}" / "events.jsonl", edit)
    return dst


@pytest.mark.parametrize("stage", [0, 1])
def test_each_stages_model_bubble_is_the_time_models_replay_of_the_schedule(reconciled, stage):
    """Catches the model row's prediction replaced by the measured bubble (pipeline.model_bubble_row): the
    prediction is the time model's figure for the stage, computed from the config and the sweeps alone."""
    r = only(reconciled[PP2], MODEL_BUBBLE, stage=stage)
    assert r.predicted == model(PP2).step.stages[stage].bubble
    assert 0 < r.predicted < 1 and r.measured != r.predicted


def test_a_moved_measured_bubble_leaves_the_prediction_where_it_was(reconciled, tmp_path):
    """Catches the same mutation through the run: stage 1's forward and backward ranges cut to half their length
    (start kept, end moved) leave it idle for longer, so its measured bubble grows, while the prediction, which no
    timer feeds, does not move."""
    before = only(reconciled[PP2], MODEL_BUBBLE, stage=1)
    after = only(reconcile_recorded(shrunk_compute(FIXTURES / PP2, tmp_path / "run", rank=1, factor=0.5)), MODEL_BUBBLE,
                 stage=1)
    assert after.measured > before.measured + 0.05
    assert after.predicted == before.predicted


@pytest.mark.parametrize("stage", [0, 1])
def test_a_bubble_within_three_points_of_the_model_is_ok_and_ten_points_off_is_off(stage):
    """Catches the bubble's tolerance made infinite (pipeline.BUBBLE_ABS_TOL): the model's bubble is judged to 3
    percentage points of the step (docs/formulas.md, "Tolerances"), so a measurement within them is ok, one beyond
    WARN_FACTOR times them (9 points) is off, on each stage of the recorded run's model."""
    predicted = model(PP2).step.stages[stage].bubble
    where = dict(rank=stage, stage=stage, source="timers")
    assert BUBBLE_ABS_TOL == 0.03
    near = model_bubble_row(model(PP2), stage, predicted + 0.025, 0.2, where)
    far = model_bubble_row(model(PP2), stage, predicted + 0.03 * WARN_FACTOR + 0.01, 0.2, where)
    below = model_bubble_row(model(PP2), stage, predicted - 0.03 * WARN_FACTOR - 0.01, 0.2, where)
    assert (near.predicted, near.verdict) == (predicted, "ok")
    assert (far.predicted, far.verdict) == (below.predicted, below.verdict) == (predicted, "off")


@pytest.mark.parametrize("fixture, group, ranks", [(PP2, "embedding", (0, 1)), (DP2, "dp", (0, 1))])
def test_exposed_communication_is_judged_against_the_time_models_figure_for_the_stage(reconciled, fixture, group,
                                                                                      ranks):
    """Catches reconcile.run.exposed_predictions returning the rank's own measured exposed time: each rank's row
    holds the time model's exposed time of its stage's group, the same figure on both DP ranks of one stage whatever
    each measured, and its verdict is the judgment of the measurement against that figure."""
    rows = [only(reconciled[fixture], f"overlap.exposed_{group}_comm_per_step", rank=rank) for rank in ranks]
    for r in rows:
        assert r.predicted == model(fixture).step.stages[r.stage].exposed[group] > 0
        assert r.measured is not None and r.measured != r.predicted
    if fixture == DP2:
        assert rows[0].predicted == rows[1].predicted and rows[0].measured != rows[1].measured
