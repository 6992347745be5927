"""The HolisticTraceAnalysis cross-check: the ledger's own overlap under HTA's definition, and HTA itself when it
is installed (pip install 'train-ledger[hta]')."""
from __future__ import annotations

from pathlib import Path

import pytest

from common.errors import ConfigError
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


@pytest.mark.slow
def test_hta_agrees_with_the_ledger(tmp_path):
    pytest.importorskip("hta")
    run, _ = make_run(tmp_path / "run")
    inputs = {r: hta.cross_check_input(summarize(next(run.glob(f"traces/rank{r}.*")))) for r in range(4)}
    rows, missing = hta.hta_rows(inputs, hta.HtaChoice("all"))
    assert missing == [] and len(rows) == 4
    for r in rows:
        assert r.measured == pytest.approx(r.predicted, abs=1e-3) and r.verdict == "ok"


@pytest.mark.slow
def test_hta_reads_a_run_given_by_a_relative_path(tmp_path, monkeypatch):
    """`train-ledger reconcile runs/x` from the run's parent: HTA resolves relative trace paths under its own
    default trace directory, so the cross-check must hand it absolute ones (a traceback before the fix)."""
    pytest.importorskip("hta")
    make_run(tmp_path / "run")
    monkeypatch.chdir(tmp_path)
    inputs = {r: hta.cross_check_input(summarize(next(Path("run").glob(f"traces/rank{r}.*")))) for r in range(4)}
    rows, missing = hta.hta_rows(inputs, hta.HtaChoice("all"))
    assert missing == [] and len(rows) == 4


def test_hta_ranks_choose_a_bounded_subset():
    traced = [0, 1, 2, 3, 4, 5, 6, 7]
    assert hta.HtaChoice.parse("ends").pick(traced) == [0, 7]  # the default
    assert hta.HtaChoice().pick([3]) == [3]
    assert hta.HtaChoice.parse("all").pick(traced) == traced
    assert hta.HtaChoice.parse("none").pick(traced) == []
    assert hta.HtaChoice.parse("1,5-6,9").pick(traced) == [1, 5, 6]  # 9 has no GPU trace
    with pytest.raises(ConfigError, match="--hta-ranks"):
        hta.HtaChoice.parse("first")


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory):
    run, _ = make_run(tmp_path_factory.mktemp("hta") / "run")
    return {r: hta.cross_check_input(summarize(next(run.glob(f"traces/rank{r}.*")))) for r in range(4)}


def test_none_runs_no_hta_and_says_so(four_ranks):
    rows, missing = hta.hta_rows(four_ranks, hta.HtaChoice.parse("none"))
    assert rows == [] and missing == ["HTA cross-check not run (--hta-ranks none)"]


@pytest.mark.slow
def test_the_default_checks_the_first_and_last_rank_and_names_the_others(four_ranks):
    pytest.importorskip("hta")
    rows, missing = hta.hta_rows(four_ranks)
    assert [r.rank for r in rows] == [0, 3] and all(r.verdict == "ok" for r in rows)
    assert missing == ["HTA cross-check run on rank(s) 0, 3 only of the 4 traced GPU ranks, not on 1-2 "
                       "(--hta-ranks all checks every rank)"]


def test_hta_over_its_memory_cap_is_stopped_and_named(four_ranks):
    """64 MiB of data segment is less than importing HTA's numpy and pandas takes: the child fails, no row is made
    for the rank, and the reconciliation says which rank and which cap."""
    pytest.importorskip("hta")
    rows, missing = hta.hta_rows(four_ranks, hta.HtaChoice("ranks", frozenset({2}), memory_mib=64))
    assert rows == [] and len(missing) == 2
    assert missing[1].startswith("HTA cross-check of rank 2 stopped: ") and "memory cap of 64 MiB" in missing[1]


def test_hta_over_its_time_budget_is_stopped_and_named(four_ranks):
    pytest.importorskip("hta")
    rows, missing = hta.hta_rows(four_ranks, hta.HtaChoice("ranks", frozenset({1}), seconds=0.05))
    assert rows == [] and missing[1] == "HTA cross-check of rank 1 stopped: over its time budget of 0.05 s"
