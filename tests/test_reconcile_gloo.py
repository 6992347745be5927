"""A real 2-rank CPU (gloo) run of the engine with every CPU probe on, reconciled, reported and exported: the
probes' actual records, not a fixture's idea of them."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys

import pytest

from ledger.reconcile.run import reconcile

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def gloo_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("gloo") / "run"
    argv = [sys.executable, "-m", "cli.main", "train", "--nproc-per-node", "2", "--model", "tiny",
            "--pipeline-model-parallel-size", "2", "--global-batch-size", "4", "--micro-batch-size", "1",
            "--train-iters", "3", "--timers", "--bandwidth-sweep", "--use-pytorch-profiler", "--profile-step-start",
            "1", "--profile-step-end", "2", "--profile-ranks", "0", "1", "--run-dir", str(run)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return run


def test_gloo_run_reconciles(gloo_run):
    result = reconcile(gloo_run)
    assert result.run["status"] == "complete" and result.run["ranks_with_events"] == [0, 1]
    static = [r for r in result.rows if r.metric == "memory.static_after_first_step"]
    assert len(static) == 2 and all(r.measured is not None and r.source == "tensor_census" for r in static)
    assert all(r.verdict == "ok" for r in static)  # formula, the engine's inventory and the CPU census agree
    p2p = [r for r in result.rows if r.metric.endswith("send_recv.bytes_per_step")]
    assert p2p and all(r.predicted == r.inventory == r.measured for r in p2p)
    assert {r.stage for r in result.rows if r.metric == "pipeline.bubble_of_wall_time"} == {0, 1}
    assert any("no GPU kernels" in m for m in result.missing)
    groups = [r for r in result.rows if r.metric == "topology.rank_groups"]  # the engine's real process groups
    assert [(r.rank, r.measured, r.verdict) for r in groups] == [(0, 0, "ok"), (1, 0, "ok")]


def test_gloo_run_report_and_trace(gloo_run, tmp_path):
    from cli.main import main as cli

    assert cli(["report", str(gloo_run)]) == 0
    out = tmp_path / "merged.json.gz"
    assert cli(["export-trace", str(gloo_run), "--out", str(out), "--steps", "1-2"]) == 0
    events = json.loads(gzip.decompress(out.read_bytes()))["traceEvents"]
    assert {e["args"]["name"] for e in events if e.get("name") == "process_name"} == {
        "rank 0 (tp0 dp0 pp0)", "rank 1 (tp0 dp0 pp1)"}
    assert any(e.get("name", "").startswith("forward stage0") for e in events)  # user annotations kept
    assert any(e.get("ph") == "C" for e in events)
