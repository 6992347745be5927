"""Real CPU (gloo) runs with stages of different layer counts, reconciled: the ledger's per-stage formulas against the
engine's inventory and the tensor census of the ranks that ran.

  uneven       Megatron-LM's --decoder-first/last-pipeline-num-layers: 4 layers over 3 stages as 1, 2, 1
  ends         --account-for-embedding/loss-in-pipeline-split: 2 layers and the two ends over 2 stages x 2 chunks,
               the first chunk the embedding alone, the last the loss alone
  layout       --pipeline-model-parallel-layout "Et|tt|t|L": 4 layers over 2 stages x 2 chunks as 1 | 2 | 1 | none
"""
from __future__ import annotations

import subprocess
import sys

import pytest

from ledger.reconcile.run import reconcile

pytestmark = pytest.mark.slow

LAYOUTS = {
    "uneven": (3, ["--num-layers", "4", "--pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers",
                   "1", "--decoder-last-pipeline-num-layers", "1", "--global-batch-size", "6"]),
    "ends": (2, ["--num-layers", "2", "--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size",
                 "2", "--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split",
                 "--global-batch-size", "4"]),
    "layout": (2, ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout",
                   "Et|tt|t|L", "--global-batch-size", "4"]),
}
# "N layer(s) per chunk" in each stage's forward row
CHUNK_LAYERS = {"uneven": {0: "1", 1: "2", 2: "1"}, "ends": {0: "0-1", 1: "0-1"}, "layout": {0: "1", 1: "0-2"}}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def run(request, tmp_path_factory):
    world, flags = LAYOUTS[request.param]
    run_dir = tmp_path_factory.mktemp(request.param) / "run"
    argv = [sys.executable, "-m", "cli.main", "train", "--nproc-per-node", str(world), "--model", "tiny", *flags,
            "--untie-embeddings-and-output-weights", "--micro-batch-size", "1", "--train-iters", "3", "--timers",
            "--compute-sweep", "--run-dir", str(run_dir)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return request.param, reconcile(run_dir)


def test_static_memory_per_stage_reconciles(run):
    """Each rank's static bytes from the formula equal the engine's inventory and the census, the stages holding
    different layer counts (a middle stage of two layers and nothing else; a stage of one layer and the embedding)."""
    _, result = run
    static = [r for r in result.rows if r.metric == "memory.static_after_first_step"]
    assert static and all(r.verdict == "ok" and r.predicted == r.inventory for r in static)
    assert all(r.verdict == "ok" for r in result.rows if r.metric == "memory.bytes_per_param")


def test_stage_rows_name_each_stage_layer_count(run):
    layout, result = run
    forward = {r.stage: r.explanation for r in result.rows if r.metric == "time.forward_per_microbatch"}
    assert {s: text.split(" layer(s) per chunk")[0].rsplit(" ", 1)[-1] for s, text in forward.items()} \
        == CHUNK_LAYERS[layout]
