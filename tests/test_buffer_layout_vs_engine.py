"""The ledger's buffer layout (ledger/models/formulas/buffer_layout.py) against the engine's, read from a real run's
inventory: every rank's buckets, chunk by chunk, as the engine laid them out.

The case that needs a real run: interleaved pipelining with --overlap-grad-reduce. Megatron buckets only the first
model chunk (later chunks reduce in the cooldown, one bucket per buffer) and only pipeline rank 0 (the others sync
in the bubble); the ledger says so, and this test holds the engine to it (it failed before the engine stopped
bucketing later chunks)."""
from __future__ import annotations

import json

import pytest
import torch

from common.arguments import parse_args
from common.config import RunConfig
from engine import train
from ledger.models.formulas.buffer_layout import rank_buffers
from tests.support.gloo import run_distributed

FLAGS = ["--model", "tiny", "--num-layers", "4", "--pipeline-model-parallel-size", "2",
         "--num-layers-per-virtual-pipeline-stage", "1", "--global-batch-size", "4", "--micro-batch-size", "1",
         "--use-distributed-optimizer", "--overlap-grad-reduce", "--ddp-bucket-size", "20000", "--train-iters", "1"]


def train_rank(rank: int, world_size: int, argv: list[str]) -> None:
    """One rank of the run as `python -m engine.train` runs it under the probes (this test is about the engine's
    buffers, not the launcher: tests/test_train_cli.py starts runs through the CLI)."""
    train.run(parse_args(argv, world_size=world_size), argv, torch.device("cpu"))


@pytest.mark.slow
def test_interleaved_overlap_buckets_only_the_first_chunk_of_the_first_stage(tmp_path):
    run = tmp_path / "run"
    run_distributed(train_rank, 4, [*FLAGS, "--run-dir", str(run)])
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
