"""The HolisticTraceAnalysis cross-check: the ledger's own overlap under HTA's definition, and HTA itself when it
is installed (pip install 'train-ledger[hta]')."""
from __future__ import annotations

from pathlib import Path

import pytest

from ledger.evidence.traces import Collective, TraceSummary, summarize
from ledger.reconcile import hta
from tests.fixtures.synthetic_run import make_run


def test_ledger_overlap_drops_the_last_step_like_hta():
    s = TraceSummary(path=Path("t"), rank=0, world_size=1, backend="nccl", on_gpu=True,
                     steps={1: (0, 100), 2: (100, 200), 3: (200, 300)},
                     compute=[(0, 50), (100, 150), (200, 300)],
                     collectives=[Collective("all_reduce", a, a + 20, 4, (0, 1)) for a in (40, 140, 240)])
    assert hta.ledger_overlap(s) == pytest.approx(0.5)  # 10 of 20 µs in steps 1 and 2; step 3 (all covered) dropped


def test_cpu_traces_are_not_cross_checked(tmp_path):
    s = TraceSummary(path=tmp_path, rank=0, world_size=1, backend="gloo")
    rows, missing = hta.hta_rows({0: hta.cross_check_input(s)})
    assert rows == [] and "CPU run" in missing[0]


def test_missing_hta_is_reported(tmp_path, monkeypatch):
    run, _ = make_run(tmp_path / "run")
    monkeypatch.setattr(hta, "available", lambda: False)
    inputs = {r: hta.cross_check_input(summarize(next(run.glob(f"traces/rank{r}.*")))) for r in range(4)}
    rows, missing = hta.hta_rows(inputs)
    assert rows == [] and "train-ledger[hta]" in missing[0]


def test_hta_agrees_with_the_ledger(tmp_path):
    pytest.importorskip("hta")
    run, _ = make_run(tmp_path / "run")
    inputs = {r: hta.cross_check_input(summarize(next(run.glob(f"traces/rank{r}.*")))) for r in range(4)}
    rows, missing = hta.hta_rows(inputs)
    assert missing == [] and len(rows) == 4
    for r in rows:
        assert r.measured == pytest.approx(r.predicted, abs=1e-3) and r.verdict == "ok"


def test_hta_reads_a_run_given_by_a_relative_path(tmp_path, monkeypatch):
    """`train-ledger reconcile runs/x` from the run's parent: HTA resolves relative trace paths under its own
    default trace directory, so the cross-check must hand it absolute ones (a traceback before the fix)."""
    pytest.importorskip("hta")
    make_run(tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    inputs = {r: hta.cross_check_input(summarize(next(Path("run").glob(f"traces/rank{r}.*")))) for r in range(4)}
    rows, missing = hta.hta_rows(inputs)
    assert missing == [] and len(rows) == 4
