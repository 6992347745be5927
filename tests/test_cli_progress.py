"""Long commands show progress on stderr where a person watches (a terminal, or TRAIN_LEDGER_PROGRESS=1) and add
nothing when stderr is not a terminal or with --json. pytest's captured stderr is not a terminal."""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

from cli import buffer as buffer_command
from cli.main import main as cli

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture
def run(tmp_path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "gloo_dp2_overlap", run)
    return run


def test_export_trace_is_quiet_on_a_stderr_that_is_no_terminal(run, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("TRAIN_LEDGER_PROGRESS", raising=False)
    assert cli(["export-trace", str(run), "--out", str(tmp_path / "m.json.gz")]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and captured.out.startswith("wrote ")


def test_export_trace_reports_each_pass_when_progress_is_forced(run, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRAIN_LEDGER_PROGRESS", "1")
    assert cli(["export-trace", str(run), "--out", str(tmp_path / "m.json.gz")]) == 0
    captured = capsys.readouterr()
    lines = captured.err.splitlines()
    # each pass says what it starts and each trace when it is done (workers finish in no set order)
    assert [line.split(" [")[0] for line in lines] == ["export-trace: reading 1 trace",
                                                       "export-trace: read trace 1/1 (rank 0)",
                                                       "export-trace: writing 1 rank",
                                                       "export-trace: wrote rank 0 (1/1), 13,068 events so far"]
    assert all(line.endswith(" s]") for line in lines)
    assert "reading trace" not in captured.out  # stdout is what it was


def test_reconcile_reports_its_traces_when_progress_is_forced_but_never_with_json(run, tmp_path, capsys,
                                                                                  monkeypatch):
    monkeypatch.setenv("TRAIN_LEDGER_PROGRESS", "1")
    assert cli(["reconcile", str(run), "--out", str(tmp_path / "a")]) == 0
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" [")[0] for line in lines] == ["reconcile: reading 1 trace",
                                                       "reconcile: read trace 1/1 (rank 0)",
                                                       "reconcile: step decomposition and replay of rank(s) 0, "
                                                       "1 at a time"]
    assert cli(["reconcile", str(run), "--out", str(tmp_path / "b"), "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and json.loads(captured.out)["run"]["traces"]


def test_a_bad_progress_setting_is_one_line_and_exit_2(run, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("TRAIN_LEDGER_PROGRESS", "yes")
    assert cli(["export-trace", str(run), "--out", str(tmp_path / "m.json.gz")]) == 2
    err = capsys.readouterr().err
    assert "TRAIN_LEDGER_PROGRESS='yes'" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "m.json.gz").exists()


@pytest.fixture
def quick_toy(monkeypatch):
    """Plumbing: the buffer toy's launch replaced by a process that writes a result at once (the real toy takes
    ~20 s and is tested in test_buffer_toy.py); its report is not what these tests are about."""
    def command(launch, module, args):
        out = args[args.index("--out") + 1]
        return [sys.executable, "-c", f"import json; json.dump({{'matches': True}}, open({out!r}, 'w'))"]

    monkeypatch.setattr(buffer_command, "torchrun_command", command)
    monkeypatch.setattr(buffer_command, "format_report", lambda result: "report")


def test_buffer_shows_its_ranks_running_when_progress_is_forced(quick_toy, capsys, monkeypatch):
    monkeypatch.setenv("TRAIN_LEDGER_PROGRESS", "1")
    assert cli(["buffer"]) == 0
    captured = capsys.readouterr()
    assert [line.split(" [")[0] for line in captured.err.splitlines()] == [
        "buffer: 2 gloo ranks (torchrun) running the toy's 2 steps and the single-process check",
        "buffer: ranks finished (exit 0)"]
    assert captured.out == "report\n"


def test_buffer_is_quiet_with_json_and_on_a_stderr_that_is_no_terminal(quick_toy, capsys, monkeypatch):
    monkeypatch.setenv("TRAIN_LEDGER_PROGRESS", "1")
    assert cli(["buffer", "--json"]) == 0
    captured = capsys.readouterr()
    assert captured.err == "" and json.loads(captured.out) == {"matches": True}
    monkeypatch.delenv("TRAIN_LEDGER_PROGRESS")
    assert cli(["buffer"]) == 0
    assert capsys.readouterr().err == ""


def test_a_wait_with_nothing_to_report_still_ticks(capsys):
    import time

    from cli.progress import Progress

    # Waits until two ticks came (up to 10 s) rather than for a fixed time: on a loaded 2-core machine the ticking
    # thread can miss a 50 ms slot (a fixed 0.18 s once saw one tick in CI).
    progress = Progress("demo", True)
    err = ""
    with progress.waiting("ranks running", every_s=0.05):
        deadline = time.monotonic() + 10
        while err.count("(still running)") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
            err += capsys.readouterr().err
    lines = [line.split(" [")[0] for line in (err + capsys.readouterr().err).splitlines()]
    assert lines[0] == "demo: ranks running" and len(lines) >= 3
    assert set(lines[1:]) == {"demo: ranks running (still running)"}
