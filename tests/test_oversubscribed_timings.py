"""Timings of CPU ranks that outnumber their cores are shown, not judged (ledger.reconcile.oversubscribed).

The claim that such timings cannot be judged, and reconcile's handling of them, are tested on a committed real run
(tests/fixtures/gloo_4ranks_2cores: four gloo ranks on two cores, with the sweeps that let the time model predict
every timed row); the rule's bookkeeping on hand-made rows (plumbing).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from ledger.reconcile.oversubscribed import NOT_JUDGED, is_timed, set_aside
from ledger.reconcile.rows import identity_row, row
from ledger.reconcile.run import reconcile

FIXTURES = Path(__file__).parent / "fixtures"
JUDGED = ("ok", "warn", "off")


def shared_run(tmp_path: Path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "gloo_4ranks_2cores", run)
    return reconcile(run)


def test_the_time_model_cannot_predict_waiting_for_a_core(tmp_path) -> None:
    # What the rule is for, on the real run: the model prices two ranks per core (compute x2), the scheduler's order
    # it cannot, and the measured step is an order of magnitude past the prediction.
    (step,) = [r for r in shared_run(tmp_path).rows if r.metric == "throughput.step_time"]
    assert step.predicted is not None and step.measured > 10 * step.predicted
    assert "compute scaled x2.00: 4 ranks" in step.explanation


def test_the_rule_sets_timings_aside_and_nothing_else() -> None:
    """Plumbing: hand-made rows, one of each kind the rule must tell apart."""
    bubble = row("pipeline.bubble_of_wall_time", "rank", predicted=0.1, measured=0.4, unit="fraction",
                 tolerance=0.1, explanation="idle / span", rank=0)
    tokens = identity_row("throughput.tokens_per_step", "run", measured=512.0, unit="tokens", explanation="g x s")
    memory = row("memory.static_after_first_step", "rank", predicted=100.0, measured=150.0, unit="bytes",
                 tolerance=0.01, explanation="static", rank=0)
    assert (bubble.verdict, memory.verdict) == ("off", "off")
    line = set_aside([bubble, tokens, memory], "4 ranks share host vm's 2 cores")
    assert line == ("timings not judged: 4 ranks share host vm's 2 cores; the 2 time, pipeline, overlap, "
                    "throughput and step rows show prediction and measurement with verdict n/a (1 would have been "
                    "judged)")
    assert (bubble.verdict, bubble.predicted, bubble.measured) == ("n/a", 0.1, 0.4)
    assert bubble.explanation == f"idle / span; {NOT_JUDGED}"
    assert tokens.verdict == "identity"  # agrees by construction: never judged, so nothing to set aside
    assert (memory.verdict, memory.explanation) == ("off", "static")  # not a timing: judged as before
    assert set_aside([memory], None) is None  # ranks that had their cores


def test_reconcile_shows_oversubscribed_timings_unjudged_and_says_why_once(tmp_path) -> None:
    result = shared_run(tmp_path)
    lines = [m for m in result.missing if m.startswith("timings not judged")]
    assert len(lines) == 1 and "4 ranks share host vm's 2 cores" in lines[0]
    timed = [r for r in result.rows if is_timed(r)]
    assert timed and not [r for r in timed if r.verdict in JUDGED]
    assert all(r.explanation.endswith(NOT_JUDGED) for r in timed)
    step = [r for r in timed if r.metric == "throughput.step_time"][0]
    assert step.predicted is not None and step.measured is not None  # shown, with both columns
    judged = [r for r in result.rows if not is_timed(r) and r.verdict in JUDGED]
    assert {r.metric.split(".")[0] for r in judged} == {"memory", "comm", "topology"}
