"""The ledger's buffer layout (ledger/formulas/buffer_layout.py) against the engine's, read from a real run's
inventory: every rank's buckets, chunk by chunk, as the engine laid them out.

The case that needs a real run: interleaved pipelining with --overlap-grad-reduce. Megatron buckets only the first
model chunk (later chunks reduce in the cooldown, one bucket per buffer) and only pipeline rank 0 (the others sync
in the bubble); the ledger says so, and this test holds the engine to it (it failed before the engine stopped
bucketing later chunks)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.config import RunConfig
from ledger.formulas.buffer_layout import rank_buffers

FLAGS = ["--model", "tiny", "--num-layers", "4", "--pipeline-model-parallel-size", "2",
         "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "4", "--micro-batch-size", "1",
         "--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "20000", "--train-iters", "1"]


@pytest.mark.slow
def test_interleaved_overlap_buckets_only_the_first_chunk_of_the_first_stage(tmp_path):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "cli.main", "train", "--nproc-per-node", "4", "--run-dir", str(run),
                           *FLAGS], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    manifest = json.loads((run / "manifest.json").read_text())
    cfg = RunConfig.from_dict(manifest["config"])
    for entry in manifest["ranks"]:
        rank, pp_rank = entry["rank"], entry["coords"]["pp"]
        events = [json.loads(line) for line in (run / "ranks" / f"rank{rank}" / "events.jsonl").open()]
        measured = [[(b["start"], b["end"]) for b in e["buckets"]] for e in events
                    if e["kind"] == "inventory" and e.get("tensor_kind") == "grad_buffer"]
        predicted = [layout.buckets for layout in rank_buffers(cfg, pp_rank)]
        assert measured == predicted, f"rank {rank} (pp {pp_rank})"
        assert len(measured) == 2  # two model chunks
        # The second chunk is never bucketed by size; on the last stage it holds the tied embedding's copy, which
        # the distributed optimizer gives a bucket of its own.
        assert len(measured[1]) == (2 if pp_rank == 1 else 1)
        assert (len(measured[0]) > 1) == (pp_rank == 0)  # only the first stage's first chunk has several
