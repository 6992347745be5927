"""Single-process checks of the run-directory schema and of each probe's pieces (CPU)."""
from __future__ import annotations

import gzip
import json
import os
import re
import time
from pathlib import Path

import pytest
import torch

from cli.main import main as cli_main
from common.arguments import parse_args
from common.errors import ConfigError, InputError
from common.events import event
from common.run_dir import (
    EventStream,
    EventWriter,
    events_path,
    iter_events,
    read_manifest,
    trace_files,
    trace_path,
    update_manifest,
    write_manifest,
)
from probes import manifest as manifest_mod
from probes.bandwidth import bandwidth_figures
from probes.memory import MemoryProbe
from probes.nvml import NvmlSampler
from probes.nvtx_range import Marker, check_category
from probes.profiler import ProfilerWindow, torch_profile, write_hta_trace
from probes.timers import StepTimer


def test_run_dir_round_trip(tmp_path: Path) -> None:
    cfg = parse_args(["--model", "tiny", "--run-dir", str(tmp_path)], world_size=2)
    ranks = [{"rank": r, "host": "h", "device": {"type": "cpu"}, "coords": {"tp": 0, "cp": 0, "dp": r, "pp": 0},
              "probes": {}} for r in range(2)]
    write_manifest(tmp_path, manifest_mod.build_manifest(cfg, ["--model", "tiny"], ranks, "run-1"))
    m = read_manifest(tmp_path)
    assert m["schema_version"] == 1 and m["status"] == "running" and m["world_size"] == 2
    assert type(cfg).from_dict(m["config"]) == cfg
    writer = EventWriter(tmp_path, 1)
    writer.write(event("step", 3, loss=1.5, lr=0.1))
    writer.write(event("memory", None, point="after_model_build", **{"allocated_bytes.all.current": 7}))
    writer.close()
    events = list(iter_events(tmp_path, 1))
    assert [(e.kind, e.step) for e in events] == [("step", 3), ("memory", None)]
    assert events[0].loss == 1.5 and events[1].allocated == 7
    assert [e.kind for e in iter_events(tmp_path, 1, {"memory"})] == ["memory"]
    trace_path(tmp_path, 1, 4, 6).parent.mkdir()
    trace_path(tmp_path, 1, 4, 6).write_bytes(b"")
    assert trace_files(tmp_path) == [(1, 4, 6, trace_path(tmp_path, 1, 4, 6))]


def test_torn_tail_tolerated_but_corruption_is_an_error(tmp_path: Path) -> None:
    writer = EventWriter(tmp_path, 0)
    writer.write(event("step", 1))
    writer.close()
    with open(events_path(tmp_path, 0), "ab") as f:
        f.write(b'{"kind":"st')
    stream = EventStream(tmp_path, 0)
    assert [e.step for e in stream] == [1] and stream.torn_tail
    with open(events_path(tmp_path, 0), "ab") as f:
        f.write(b'\n{"kind":"step","step":2,"t":0}\n')
    with pytest.raises(InputError, match="line 2"):
        list(iter_events(tmp_path, 0))


def test_manifest_failure_is_never_overwritten_by_complete(tmp_path: Path) -> None:
    write_manifest(tmp_path, {"run_id": "r", "world_size": 2, "status": "running", "ended": None})
    manifest_mod.finish(tmp_path, 1, "complete", None)  # only rank 0 may say complete
    assert read_manifest(tmp_path)["status"] == "running"
    manifest_mod.finish(tmp_path, 1, "failed", "RuntimeError: boom")
    manifest_mod.finish(tmp_path, 0, "complete", None)
    m = read_manifest(tmp_path)
    assert (m["status"], m["error"], m["failed_rank"]) == ("failed", "RuntimeError: boom", 1) and m["ended"]
    update_manifest(tmp_path, status="bogus")
    with pytest.raises(InputError, match="status"):
        read_manifest(tmp_path)


def test_the_first_failure_is_the_one_recorded(tmp_path: Path) -> None:
    """Rank 1 fails of a bad file; rank 0 fails after, of the peer it lost (or torchrun's SIGTERM): the run's error
    stays the cause."""
    write_manifest(tmp_path, {"run_id": "r", "world_size": 2, "status": "running", "ended": None})
    manifest_mod.finish(tmp_path, 1, "failed", "InputError: rank_00001.pt: is not a whole checkpoint file")
    manifest_mod.finish(tmp_path, 0, "failed", "RuntimeError: Connection closed by peer")
    manifest_mod.finish(tmp_path, 0, "failed", "Terminated: stopped by SIGTERM")
    m = read_manifest(tmp_path)
    assert (m["error"], m["failed_rank"]) == ("InputError: rank_00001.pt: is not a whole checkpoint file", 1)


@pytest.mark.parametrize("flags, problem", [
    (["--nvml-interval", "-1"], "--nvml-interval"),
    (["--profile-step-start", "5", "--profile-step-end", "3"], "--profile-step-end"),
    (["--use-pytorch-profiler", "--profile-ranks", "4"], "--profile-ranks 4"),
    (["--profile-ranks", "x"], "--profile-ranks"),
    (["--nvml-intervall", "1"], "unsupported flag"),
])
def test_bad_probe_flags_are_config_errors(flags: list[str], problem: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(ConfigError, match=re.escape(problem)):
        parse_args(["--model", "tiny", *flags], world_size=2)
    # Through the CLI: one line on stderr, exit status 2 (`plan` parses the same flags without running anything).
    assert cli_main(["plan", "--model", "tiny", "--world-size", "2", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and problem.split()[0] in err


def test_nccl_tests_bandwidth_conventions() -> None:
    # 1 GB in 1 s on 4 ranks: busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n for gather/scatter, x 1 for p2p.
    assert bandwidth_figures("all_reduce", 10**9, 1.0, 4) == {"algbw_GBps": 1.0, "busbw_GBps": 1.5}
    assert bandwidth_figures("all_gather", 10**9, 0.5, 4) == {"algbw_GBps": 2.0, "busbw_GBps": 1.5}
    assert bandwidth_figures("reduce_scatter", 10**9, 1.0, 2)["busbw_GBps"] == 0.5
    assert bandwidth_figures("send_recv", 2 * 10**9, 1.0, 2)["busbw_GBps"] == 2.0


def test_hta_trace_format(tmp_path: Path) -> None:
    raw = tmp_path / "raw.json"
    raw.write_text('{"distributedInfo":{"backend":"gloo","rank":3},"traceEvents":['
                   '{"ph":"X","ts":10.4,"dur":0.3},{"ph":"X","ts":10.7,"dur":1.0},{"ph":"i","ts":3.6}]}')
    out = tmp_path / "rank3.step1-2.json.gz"
    write_hta_trace(raw, out, 3, 8, run_id="run-a", steps=(1, 3), window=(1, 2))
    text = gzip.decompress(out.read_bytes()).decode()
    assert re.search(r'"rank": (\d+)', text).group(1) == "3"
    trace = json.loads(text)
    assert trace["distributedInfo"] == {"backend": "gloo", "rank": 3, "world_size": 8}
    assert trace["trainLedger"]["steps_recorded"] == [1, 3] and trace["trainLedger"]["run_id"] == "run-a"
    # Whole microseconds, ends rounded too: the first event still ends where the second begins.
    assert [(e["ts"], e.get("dur")) for e in trace["traceEvents"]] == [(10, 1), (11, 1), (4, None)]


def test_cpu_timer_intervals_nest_and_span_steps() -> None:
    timer = StepTimer(use_cuda=False)
    timer.step_begin(1)
    outer = timer.start("iteration", "iteration", {})
    inner = timer.start("forward", "forward", {"microbatch": 0})
    time.sleep(0.01)
    timer.stop(inner)
    comm = timer.comm_begin("all-reduce bucket0", "dp-comm", {"bucket": 0})
    timer.comm_end(comm)
    first = timer.collect()
    assert [r["name"] for r in first] == ["forward", "all-reduce bucket0"]  # the open iteration range waits
    fwd = first[0]
    assert fwd["step"] == 1 and fwd["microbatch"] == 0 and fwd["duration_s"] >= 0.01 and "async_comm" not in fwd
    assert fwd["t_end"] - fwd["t_start"] == pytest.approx(fwd["duration_s"], abs=1e-6)
    # the host's clock of the same range: on the CPU it is the range's own clock, so the two agree
    assert fwd["host_end_s"] - fwd["host_start_s"] == pytest.approx(fwd["duration_s"], abs=1e-4)
    assert 0 <= fwd["host_start_s"] <= fwd["start_s"] + 1e-4
    assert first[1]["async_comm"] and first[1]["issue_s"] <= first[1]["wait_return_s"]
    timer.stop(outer)
    timer.step_begin(2)
    (late,) = timer.collect()
    assert late["name"] == "iteration" and late["step"] == 1 and late["start_s"] <= fwd["start_s"]


def test_the_profiler_window_flags_the_steps_it_disturbs(tmp_path: Path) -> None:
    # Window 2-3 on rank 0 of 2: torch.profiler records 2, 3 and one more step for HTA (4), then writes its trace at
    # the end of step 4; step 5 is the one every rank spends waiting for that export. Rank 1 profiles nothing but
    # still waits in step 5. A world of one has nobody to wait for.
    profiled = ProfilerWindow(tmp_path, 0, 2, "run-a", 2, 3, [0], True, False)
    bystander = ProfilerWindow(tmp_path, 1, 2, "run-a", 2, 3, [0], True, False)
    flags = []
    for step in range(1, 7):
        for w in (profiled, bystander):
            w.step_begin(step)
        torch.ones(4).add_(1)
        flags.append((step, profiled.recording, bystander.recording, profiled.follows_export(step),
                      bystander.follows_export(step)))
        for w in (profiled, bystander):
            w.step_end(step)
    assert [s for s, rec, *_ in flags if rec] == [2, 3, 4] and not any(f[2] for f in flags)
    assert [s for s, _, _, a, b in flags if a and b] == [5] and not any(f[3] != f[4] for f in flags)
    assert profiled.written is not None and profiled.written.is_file()
    alone = ProfilerWindow(tmp_path / "alone", 0, 1, "run-b", 2, 3, [0], True, False)
    assert not any(alone.follows_export(step) for step in range(10))


@pytest.mark.parametrize("cuda, preset, expected", [
    ("13.0", None, "1"), ("12.6", None, "1"), ("12.4", None, None), (None, None, None), ("13.0", "0", "0")])
def test_the_window_detaches_cupti_when_it_stops_where_cuda_allows_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cuda: str | None, preset: str | None,
        expected: str | None) -> None:
    # Kineto detaches CUPTI at a profiler's stop only under TEARDOWN_CUPTI=1; attached, it slows every CUDA call
    # after the window. Only the window's stop asks: the host sweep's profiled half (torch_profile at start-up) keeps
    # CUPTI warm for the window. Before CUDA 12.6 re-attaching after a teardown crashed with CUDA graphs (torch's own
    # rule); a user's value is kept.
    monkeypatch.setattr(torch.version, "cuda", cuda)
    if preset is None:
        monkeypatch.delenv("TEARDOWN_CUPTI", raising=False)
    else:
        monkeypatch.setenv("TEARDOWN_CUPTI", preset)
    torch_profile()
    assert os.environ.get("TEARDOWN_CUPTI") == preset
    window = ProfilerWindow(tmp_path, 0, 1, "run-c", 2, 3, [0], True, False)
    for step in range(1, 6):
        window.step_begin(step)
        torch.ones(4).add_(1)
        window.step_end(step)
    assert window.written is not None and os.environ.get("TEARDOWN_CUPTI") == expected


def test_ranges_after_step_end_belong_to_no_step() -> None:
    # The engine's forced param all-gather after the last step must not be timed as part of that step.
    timer = StepTimer(use_cuda=False)
    timer.step_begin(4)
    timer.stop(timer.start("forward", "forward", {}))
    timer.step_end()
    timer.comm_end(timer.comm_begin("all-gather bucket0", "dp-comm", {"bucket": 0}))
    assert [(r["name"], r["step"]) for r in timer.collect()] == [("forward", 4), ("all-gather bucket0", None)]


def test_cpu_fallbacks_say_what_they_are() -> None:
    record = MemoryProbe(use_cuda=False).read_step()
    assert record["device"] == "cpu" and record["rss_bytes"] > 0 and "RSS" in record["note"]
    sampler = NvmlSampler(0.1)
    assert sampler.status.startswith("disabled") and sampler.drain() == []
    sampler.stop()
    assert NvmlSampler(0.0).status == "off"
    marker = Marker(nvtx_on=False)
    assert marker.backend == "off" and not marker.nvtx_active
    rf = marker.enter("forward", "forward")
    marker.exit(rf)
    with pytest.raises(ValueError, match="category"):
        check_category("fwd")


GPU_FIXTURE = Path(__file__).parent / "fixtures" / "gpu_h200_llama1b_l2"


def test_real_gpu_run_directory_reads_back() -> None:
    """A committed H200 run (llama3.2-1b shape, 2 layers, every probe on): what the CUDA paths wrote."""
    m = read_manifest(GPU_FIXTURE)
    assert m["status"] == "complete" and m["ranks"][0]["device"]["type"] == "cuda"
    assert m["ranks"][0]["probes"]["timers"] == "cuda_event" and m["ranks"][0]["probes"]["nvml"].startswith("sampling")
    events = list(iter_events(GPU_FIXTURE, 0))
    points = [e.point for e in events if e.kind == "memory" and e.point != "step"]
    assert points == ["after_model_build", "after_ddp_buffers", "after_optimizer_init", "after_first_step"]
    step_mem = [e for e in events if e.kind == "memory" and e.point == "step"]
    assert all(e.reserved >= e.peak > 0 for e in step_mem)
    assert {e.clock for e in events if e.kind == "timing"} == {"cuda_event"}
    assert all(e.used_bytes > 0 for e in events if e.kind == "nvml")
    ((rank, start, end, path),) = trace_files(GPU_FIXTURE)
    text = gzip.decompress(path.read_bytes()).decode()
    assert (rank, start, end) == (0, 3, 4) and re.search(r'"rank": (\d+)', text).group(1) == "0"
    assert json.loads(text)["trainLedger"]["run_id"] == m["run_id"]
    assert all(isinstance(e["ts"], int) for e in json.loads(text)["traceEvents"] if "ts" in e)
