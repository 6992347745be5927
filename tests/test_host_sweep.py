"""The start-up host sweep (probes/host_sweep.py, --host-sweep): the host's seconds per call of each primitive of
common/ops/host.py, written as `host` records. Plumbing on this machine's CPU (what it measures here is this loaded
host's, not a figure to check); what the figures do in the time model is tests/test_host_model.py's."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from common.arguments import parse_args
from common.events import HostRecord, event, parse_event
from common.ops.host import DEVICE_ONLY, HOST_PRIMITIVES
from probes.host_sweep import run
from probes.probe_set import ProbeSet

CPU_PRIMITIVES = [op for op in HOST_PRIMITIVES if op not in DEVICE_ONLY]  # no launch, compile, event, sync, graph


@pytest.fixture(scope="module")
def cpu_records() -> list[dict]:
    return run(torch.device("cpu"), profiled=True)


def test_a_cpu_rank_times_every_primitive_it_has_and_says_it_launches_nothing(cpu_records):
    assert [r["op"] for r in cpu_records] == CPU_PRIMITIVES
    for r in cpu_records:
        assert r["launches"] is False and r["device"] == "cpu" and "no kernel launch" in r["note"]
        assert r["seconds"] >= 0 and r["torch"] == torch.__version__ and r["cpu"]
        assert isinstance(event("host", None, **r), HostRecord)  # what the writer writes, the reader reads


def test_under_the_profiler_each_primitive_has_its_profiled_figure_too(cpu_records):
    assert all(r["profiled_seconds"] >= 0 for r in cpu_records)
    assert all("profiled_seconds" not in r for r in run(torch.device("cpu"), profiled=False))


def probe_set(run_dir: Path, *flags: str) -> ProbeSet:
    cfg = parse_args(["--model", "tiny", "--global-batch-size", "1", "--run-dir", str(run_dir), *flags])
    return ProbeSet(cfg, SimpleNamespace(rank=0, world_size=1, coordinates={}, ranks={}), argv=[])


@pytest.mark.parametrize("flags, written", [((), 0), (("--host-sweep",), len(CPU_PRIMITIVES))])
def test_the_probe_set_writes_host_records_only_when_asked(tmp_path: Path, flags, written):
    probes = probe_set(tmp_path / "run", *flags)
    probes.host_sweep()
    probes.close()
    lines = (tmp_path / "run" / "ranks" / "rank0" / "events.jsonl").read_text().splitlines()
    assert sum(json.loads(line)["kind"] == "host" for line in lines) == written


def test_all_probes_includes_the_host_sweep():
    base = ["--model", "tiny", "--global-batch-size", "1"]
    assert not parse_args(base).probes.host_sweep
    assert parse_args(base + ["--host-sweep"]).probes.host_sweep
    assert parse_args(base + ["--all-probes"]).probes.host_sweep


def test_a_later_writers_host_line_keeps_its_new_fields_and_a_later_kind_is_skipped():
    line = {"kind": "host", "step": None, "op": "eager", "seconds": 5e-6, "launches": True, "queue_depth": 3}
    record = parse_event(line)
    assert isinstance(record, HostRecord) and record.extra == {"queue_depth": 3}
    assert record.to_json() == {**line, "t": None}
    assert parse_event({"kind": "host_v2", "step": None, "op": "eager"}) is None


@pytest.mark.parametrize("dp, timed", [(1, True), (2, False)])
def test_the_passes_are_timed_under_overlap_param_gather_only_where_nothing_is_gathered(dp: int, timed: bool):
    # A pass timed alone must not wait for a peer: with --overlap-param-gather each module's forward pre-hook waits
    # for its all-gather, but a data-parallel group of one gathers nothing (the one-GPU demo runs so).
    from engine.probe_adapters import pass_timer
    cfg = parse_args(["--model", "tiny", "--use-distributed-optimizer", "--overlap-grad-reduce",
                      "--overlap-param-gather"])
    state = SimpleNamespace(pp_size=1, cp_size=1, ep_size=1, dp_size=dp)
    assert (pass_timer([torch.nn.Linear(1, 1)], cfg, state, torch.device("cuda")) is not None) is timed


def test_the_stream_mismatch_warning_is_off_only_around_a_capture():
    # Plumbing (no streams on a CPU): make_graphed_callables' own side streams made autograd warn in every GPU run;
    # the host sweep's stand-ins and the engine's graphed layers turn the warning off around their capture and give
    # the run its setting back, even on an error.
    from probes.graph_capture import capture_stream_mismatch_quiet
    warns = torch._C._warn_on_accumulate_grad_stream_mismatch
    assert warns()
    with pytest.raises(RuntimeError), capture_stream_mismatch_quiet():
        assert not warns()
        raise RuntimeError("a capture that failed")
    assert warns()
