"""A run is read once per command or page: every file under the run directory is opened at most once by `report`
and by each dashboard page (ledger/evidence builds one RunEvidence; the report and a page's loaders share one
RunView). Opens are counted with Python's "open" audit event, which every file open raises (builtins.open, io,
pathlib, gzip), whatever module opens it."""
from __future__ import annotations

import shutil
import sys
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import pytest

from tests.support.recorded_runs import FIXTURES

_WATCHED: list[tuple[Path, Counter]] = []


def _audit(event: str, args: tuple) -> None:
    if event != "open" or not _WATCHED or not isinstance(args[0], (str, Path)):
        return
    mode = args[1] if len(args) > 1 and isinstance(args[1], str) else "r"
    if any(c in mode for c in "wax+"):
        return
    path = Path(args[0]).resolve()
    for root, counts in _WATCHED:
        if root in path.parents:
            counts[str(path.relative_to(root))] += 1


sys.addaudithook(_audit)  # audit hooks cannot be removed: this one counts only while a test watches a folder


@contextmanager
def opens_under(root: Path) -> Iterator[Counter]:
    counts: Counter = Counter()
    _WATCHED.append((root.resolve(), counts))
    try:
        yield counts
    finally:
        _WATCHED.pop()


@pytest.fixture
def reconciled(tmp_path: Path) -> Path:
    """A real gloo DP2 run with both sweeps and a trace, reconciled (what `train-ledger report` then reads)."""
    from ledger.reconcile.run import reconcile, write

    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "gloo_dp2_sweeps", run)
    write(reconcile(run))
    return run


def test_the_counter_sees_a_second_read():
    """The test can fail: reading a file twice is counted twice."""
    manifest = FIXTURES / "gloo_dp2_sweeps" / "manifest.json"
    with opens_under(manifest.parent) as counts:
        manifest.read_text()
        manifest.read_bytes()
    assert counts["manifest.json"] == 2


def test_report_reads_each_run_file_once(reconciled: Path, tmp_path: Path):
    from ledger.present.report import write

    with opens_under(reconciled) as counts:
        write(reconciled, tmp_path / "out")
    assert counts, "the report read nothing: the counter is not watching"
    assert {"manifest.json", "ranks/rank0/events.jsonl", "ranks/rank1/events.jsonl",
            "ledger/reconciliation.json"} <= set(counts)
    assert max(counts.values()) == 1, counts


@pytest.mark.parametrize("page", ["runs", "reconciliation", "memory", "pipeline", "overlap", "topology", "traces",
                                  "what_if"])
def test_each_dashboard_page_reads_each_run_file_once(reconciled: Path, page: str, monkeypatch):
    pytest.importorskip("streamlit")
    import streamlit as st
    from streamlit.testing.v1 import AppTest

    from cli import dashboard as command
    from dashboard import state

    monkeypatch.setenv(command.RUNS_ROOT_ENV, str(reconciled.parent))
    monkeypatch.delenv(command.RUN_ENV, raising=False)
    app = Path(__file__).resolve().parents[1] / "dashboard" / "app.py"
    at = AppTest.from_file(str(app), default_timeout=120)
    at.run()
    st.cache_data.clear()
    st.cache_resource.clear()
    at.session_state[state.SELECTED] = reconciled.name
    with opens_under(reconciled) as counts:
        at.switch_page(f"pages/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    assert counts, f"page {page} read nothing of the run"
    assert max(counts.values()) == 1, (page, counts)
