"""A synthetic multi-rank "training loop" (tiny nn.Linear, micro-batches, DP/TP/PP collectives) driving the ProbeSet
exactly as the engine does, on gloo ranks; checks what lands in the run directory."""
from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from pathlib import Path

import pytest

from common.run_dir import iter_events, ranks_present, read_manifest, trace_files
from tests.support.gloo import run_distributed
from tests.support.probed_loop import synthetic_run

LIFECYCLE = ("after_model_build", "after_ddp_buffers", "after_optimizer_init", "after_first_step")

def _kinds(run_dir: Path, rank: int) -> Counter:
    return Counter(e.kind for e in iter_events(run_dir, rank))


def _check_common(run_dir: Path, world_size: int, steps: int) -> None:
    manifest = read_manifest(run_dir)
    assert manifest["status"] == "complete" and manifest["ended"]
    assert manifest["world_size"] == world_size and [r["rank"] for r in manifest["ranks"]] == list(range(world_size))
    assert manifest["config"]["parallel"]["world_size"] == world_size
    assert ranks_present(run_dir) == list(range(world_size))
    for rank in range(world_size):
        events = list(iter_events(run_dir, rank))
        points = [e.point for e in events if e.kind == "memory"]
        assert [p for p in points if p != "step"] == list(LIFECYCLE)
        assert points.count("step") == steps
        mem = next(e for e in events if e.kind == "memory")
        assert mem.device == "cpu" and mem.rss_bytes > 0
        assert [e.step for e in events if e.kind == "step"] == list(range(1, steps + 1))
        assert all(e.tokens_per_s > 0 for e in events if e.kind == "step")
        assert events[-1].kind == "run_end" and events[-1].status == "complete"


@pytest.mark.slow
def test_two_ranks_dp_every_cpu_kind(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    flags = ["--all-probes", "--use-pytorch-profiler", "--profile-step-start", "2", "--profile-step-end", "3",
             "--profile-ranks", "0", "1"]
    assert run_distributed(synthetic_run, 2, str(run_dir), flags, 1, 1, 5) == ["ProbeSet", "ProbeSet"]
    _check_common(run_dir, 2, 5)
    for rank in range(2):
        kinds = _kinds(run_dir, rank)
        assert {"memory", "inventory", "timing", "bandwidth", "step", "run_end"} <= set(kinds)
        assert "nvml" not in kinds  # no GPU: the sampler is disabled and says so in the manifest
        timings = [e for e in iter_events(run_dir, rank, {"timing"})]
        assert {t.category for t in timings} == {"iteration", "forward", "backward", "optimizer", "dp-comm"}
        fwd = [t for t in timings if t.category == "forward" and t.step == 2]
        assert [t.microbatch for t in fwd] == [0, 1] and all(t.stage == 0 for t in fwd)
        it = next(t for t in timings if t.category == "iteration" and t.step == 2)
        assert all(it.start_s <= t.start_s <= t.end_s <= it.end_s for t in timings if t.step == 2)
        comm = [t for t in timings if t.category == "dp-comm"]
        assert all(t.async_comm and t.issue_s <= t.wait_return_s for t in comm)
        sweep = {(b.group, b.collective) for b in iter_events(run_dir, rank, {"bandwidth"})}
        assert sweep == {("dp", "reduce_scatter"), ("dp", "all_gather"), ("dp", "all_reduce")}
    notes = read_manifest(run_dir)["ranks"][0]["probes"]
    assert notes["nvml"].startswith("disabled") and notes["timers"] == "perf_counter"
    traces = trace_files(run_dir)
    assert [(r, a, b) for r, a, b, _ in traces] == [(0, 2, 3), (1, 2, 3)]
    for rank, _, _, path in traces:
        text = gzip.decompress(path.read_bytes()).decode()
        assert re.search(r'"rank": (\d+)', text).group(1) == str(rank)  # HTA's rank regex
        trace = json.loads(text)
        assert trace["distributedInfo"]["rank"] == rank and trace["distributedInfo"]["world_size"] == 2
        steps = sorted(e["name"] for e in trace["traceEvents"] if e.get("name", "").startswith("ProfilerStep#"))
        assert steps == ["ProfilerStep#2", "ProfilerStep#3", "ProfilerStep#4"]  # step 4 is the one HTA drops
        names = {e.get("name") for e in trace["traceEvents"]}
        assert {"forward stage0 mb0", "backward stage0 mb1", "optimizer"} <= names  # record_function twins
    tb_files = list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert len(tb_files) == 1  # the last rank writes, as Megatron's training_log does


@pytest.mark.slow
def test_four_ranks_tp_pp(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert run_distributed(synthetic_run, 4, str(run_dir), ["--all-probes"], 2, 2, 3) == ["ProbeSet"] * 4
    _check_common(run_dir, 4, 3)
    manifest = read_manifest(run_dir)
    assert [r["coords"] for r in manifest["ranks"]][3] == {"tp": 1, "cp": 0, "dp": 0, "pp": 1}
    for rank in range(4):
        timings = list(iter_events(run_dir, rank, {"timing"}))
        assert {"tp-comm", "pp-comm"} <= {t.category for t in timings}
        assert {t.stage for t in timings if t.category == "forward"} == {rank // 2}
        sweep = {(b.group, b.collective, b.group_size) for b in iter_events(run_dir, rank, {"bandwidth"})}
        assert sweep == {("tp", "all_reduce", 2), ("tp", "all_gather", 2), ("tp", "reduce_scatter", 2),
                         ("pp", "send_recv", 2)}
    assert trace_files(run_dir) == []


@pytest.mark.slow
def test_disabled_probes_add_no_records(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    assert run_distributed(synthetic_run, 2, str(run_dir), [], 1, 1, 2) == ["ProbeSet", "ProbeSet"]
    _check_common(run_dir, 2, 2)
    for rank in range(2):
        assert set(_kinds(run_dir, rank)) == {"memory", "inventory", "step", "run_end"}
    assert not (run_dir / "traces").exists() and not (run_dir / "tb").exists()
    notes = read_manifest(run_dir)["ranks"][1]["probes"]
    assert notes["nvtx"] == notes["timers"] == notes["nvml"] == notes["profiler"] == "off"
    assert run_distributed(synthetic_run, 2, None, ["--all-probes"], 1, 1, 1) == ["NullProbeSet"] * 2
