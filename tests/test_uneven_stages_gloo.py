"""A real 3-rank CPU (gloo) run with uneven pipeline stages (Megatron-LM's --decoder-first/last-pipeline-num-layers:
4 layers as 1, 2, 1), reconciled: the ledger's per-stage formulas against the engine's inventory and the tensor
census of the ranks that ran."""
from __future__ import annotations

import subprocess
import sys

import pytest

from ledger.reconcile.run import reconcile

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def uneven_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("uneven") / "run"
    argv = [sys.executable, "-m", "cli.main", "train", "--nproc-per-node", "3", "--model", "tiny",
            "--num-layers", "4", "--pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers", "1",
            "--decoder-last-pipeline-num-layers", "1", "--untie-embeddings-and-output-weights",
            "--global-batch-size", "6", "--micro-batch-size", "1", "--train-iters", "3", "--timers", "--compute-sweep",
            "--run-dir", str(run)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return run


def test_static_memory_per_stage_reconciles(uneven_run):
    """Stage 1 holds two layers and nothing else, stages 0 and 2 one layer each beside the embedding / the final norm
    and output layer: each rank's static bytes from the formula equal the engine's inventory and the census."""
    result = reconcile(uneven_run)
    static = {r.rank: r for r in result.rows if r.metric == "memory.static_after_first_step"}
    assert sorted(static) == [0, 1, 2]
    assert all(r.verdict == "ok" and r.predicted == r.inventory for r in static.values())
    per_param = {r.rank: r for r in result.rows if r.metric == "memory.bytes_per_param"}
    assert all(r.verdict == "ok" for r in per_param.values())


def test_stage_rows_name_each_stage_layer_count(uneven_run):
    result = reconcile(uneven_run)
    forward = {r.stage: r.explanation for r in result.rows if r.metric == "time.forward_per_microbatch"}
    assert "2 layer(s) per chunk" in forward[1]
    assert "1 layer(s) per chunk" in forward[0] and "1 layer(s) per chunk" in forward[2]
