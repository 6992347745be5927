"""Reading a run's traces in worker processes (ledger.evidence.trace_pool) gives the summaries reading them one by
one in this process gives, on every trace committed under tests/fixtures (recorded runs: NCCL on H200, gloo on CPU,
Megatron-LM's profiler), and the same first error."""
from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import pytest

from common.errors import ConfigError, InputError
from ledger.evidence.trace_pool import ENV, read_trace_summaries, worker_count
from ledger.evidence.traces import summarize

FIXTURES = Path(__file__).parent / "fixtures"
TRACES = sorted(p for p in FIXTURES.rglob("*.json.gz") if p.parent.name in ("traces", "torch_profile")
                or p.parent.name == "h200_pp2_p2p_slice")


def test_the_committed_traces_are_all_found():
    # gloo: dp2_overlap, dp2_sweeps and pp2 one each, pp2_sweeps two; H200: three; the PP2 slice's two ranks;
    # Megatron-LM's seven (the 1-GPU run, the two H200 runs of megatron_lm_h200, the four of megatron_lm_h100); the
    # CUDA graphs pair's two; the
    # two profiled MoE runs (h200_moe: before and after the compiled SwiGLU rows and combine); the dense seq-4096 step;
    # the delayed expert wgrads' pair (h200_moe/delayed_wgrad); the in-place grouped GEMMs' three (h200_moe/grouped,
    # the delayed one twice: its backward reading the counts, then the flush); the one-GPU demo's window
    # (h200_host_ranges/demo_1gpu); the five held-out coverage shapes (h200_coverage_shapes); the H100 file's host
    # calibration run (h100_host_calibration)
    assert len(TRACES) == 34


@pytest.mark.slow
def test_workers_read_what_one_process_reads():
    traces = [(i, p) for i, p in enumerate(TRACES)]
    lines: list[str] = []
    parallel = read_trace_summaries(traces, workers=2, progress=lines.append)
    assert list(parallel) == TRACES  # in the order given
    assert parallel == {p: summarize(p) for p in TRACES}
    assert lines[0] == f"reading {len(TRACES)} traces in 2 processes" and len(lines) == 1 + len(TRACES)


@pytest.mark.slow
def test_the_first_unreadable_trace_is_the_error_whatever_finishes_first(tmp_path):
    good = [tmp_path / f"rank{r}.json.gz" for r in range(4)]
    for path in good:
        shutil.copy(TRACES[0], path)
    good[1].write_bytes(gzip.compress(b'{"events": []}'))
    good[3].write_bytes(b"\x1f\x8b" + b"\x00garbage" * 20)
    with pytest.raises(InputError) as caught:
        read_trace_summaries(list(enumerate(good)), workers=2)
    assert caught.value.path == good[1] and "not a Chrome trace" in caught.value.problem


def test_small_traces_are_read_in_this_process(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    lines: list[str] = []
    read_trace_summaries([(0, TRACES[0]), (1, TRACES[1])], progress=lines.append)
    assert lines == ["reading 2 traces", "read trace 1/2 (rank 0)", "read trace 2/2 (rank 1)"]


def test_worker_count_comes_from_the_flag_the_environment_or_the_cores(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    assert worker_count(3, 8) == 3 and worker_count(16, 2) == 2  # never more than there are traces
    assert 1 <= worker_count(None, 64) <= 64
    monkeypatch.setenv(ENV, "5")
    assert worker_count(None, 8) == 5 and worker_count(2, 8) == 2  # the flag wins
    with pytest.raises(ConfigError, match="--workers 0: expected"):
        worker_count(0, 8)
    monkeypatch.setenv(ENV, "many")
    with pytest.raises(ConfigError, match=f"{ENV}='many'"):
        worker_count(None, 8)
    monkeypatch.setenv(ENV, "-1")
    with pytest.raises(ConfigError, match=f"{ENV} -1: expected"):
        worker_count(None, 8)


@pytest.mark.parametrize("argv, problem", [
    (["reconcile", "--workers", "0"], "argument --workers: expected a number of worker processes (1 or more), got 0"),
    (["report", "--workers", "-2"], "argument --workers: expected a number of worker processes (1 or more), got -2"),
    (["export-trace", "--workers", "0", "--out", "x.json.gz"], "argument --workers: expected a number of worker"),
    (["reconcile", "--workers", "two"], "argument --workers: expected a number of worker processes, got 'two'"),
    (["reconcile", "--hta-ranks", "first"], "--hta-ranks 'first': expected ranks like 0,1,4-7"),
    (["report", "--hta-ranks", "3-1"], "--hta-ranks '3-1': expected ranks 0 <= A <= B"),
    (["reconcile", "--replay-ranks", "last"], "--replay-ranks 'last': expected ranks like 0,1,4-7"),
    (["report", "--replay-ranks", ","], "--replay-ranks ',': expected ends, all, none or ranks like 0,3,8-15"),
])
def test_bad_reading_flags_are_one_line(tmp_path, capsys, argv, problem):
    from cli.main import main as cli
    from tests.fixtures.synthetic_run import make_run

    run, _ = make_run(tmp_path / "run")
    assert cli([argv[0], str(run), *argv[1:]]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and problem in err, err
    assert not (run / "ledger").exists()
