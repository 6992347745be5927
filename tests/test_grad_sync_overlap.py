"""A pipelined run with --overlap-grad-reduce overlaps the DP gradient reduction as Megatron Core does, seen in the
probes' own timing records of a real PP2 x DP2 gloo run (docs/engine.md, "Schedules" and "Data parallel").

Pipeline stage 0 is the one stage whose grad buffer is split into several buckets. Backward fills the buffer from
its head, so during the last micro-batch's backward the buckets become final in order 0, 1, 2, ..., and each must be
issued then, while the rest of that backward still runs. Stage 1 is not split by bucket size (Megatron's rule: its
reduction is off the critical path); its reduction is launched after its last backward, in the pipeline bubble.
Either way every bucket is issued exactly once per step, in bucket order.

On the CPU a range's start_s / end_s and a collective's issue_s are all host perf_counter seconds since the step
began, so they compare directly.
"""
from __future__ import annotations

import pytest
import torch

from common.arguments import parse_args
from common.run_dir import iter_events
from tests.support.gloo import run_distributed

pytestmark = pytest.mark.slow

WORLD, PP = 4, 2
MICROBATCHES = 4  # a global batch of 8 over DP 2, in micro-batches of 1
ARGV = ["--model", "tiny", "--pipeline-model-parallel-size", str(PP), "--micro-batch-size", "1",
        "--global-batch-size", "8", "--train-iters", "2", "--mock-data", "--use-distributed-optimizer",
        "--overlap-grad-reduce", "--ddp-bucket-size", "10000", "--timers"]


def _train_rank(rank: int, world_size: int, argv: list[str]) -> None:
    from engine.train import run
    run(parse_args(argv, world_size=world_size), argv, torch.device("cpu"))


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("overlap") / "run"
    argv = ARGV + ["--run-dir", str(run_dir)]
    run_distributed(_train_rank, WORLD, argv)
    return run_dir


def _num_grad_buckets(run_dir, rank: int) -> int:
    (buffer,) = [e for e in iter_events(run_dir, rank, {"inventory"}) if e.tensor_kind == "grad_buffer"]
    return len(buffer.buckets)


def _steps(run_dir, rank: int) -> dict[int, tuple[dict, list[dict]]]:
    """Per step: (the last micro-batch's backward range, the reduce-scatters in the order they were issued)."""
    backwards: dict[int, list[dict]] = {}
    reductions: dict[int, list[dict]] = {}
    for e in iter_events(run_dir, rank, {"timing"}):
        assert e.clock == "perf_counter"
        if e.step is None:
            continue
        if e.category == "backward":
            backwards.setdefault(e.step, []).append(e)
        elif e.category == "dp-comm" and e.name.startswith("reduce-scatter"):
            reductions.setdefault(e.step, []).append(e)
    assert sorted(backwards) == sorted(reductions) == [1, 2]
    steps = {}
    for step, ranges in backwards.items():
        (last,) = [r for r in ranges if r.microbatch == MICROBATCHES - 1]
        steps[step] = last, sorted(reductions[step], key=lambda r: r.issue_s)
    return steps


def _ranks_of_stage(run_dir, stage: int) -> list[int]:
    stages = {rank: {e.stage for e in iter_events(run_dir, rank, {"timing"}) if e.category == "backward"}
              for rank in range(WORLD)}
    return [rank for rank, seen in stages.items() if seen == {stage}]


def test_stage0_issues_its_buckets_in_order_during_the_last_backward(run_dir):
    ranks = _ranks_of_stage(run_dir, 0)
    assert len(ranks) == WORLD // PP
    for rank in ranks:
        buckets = _num_grad_buckets(run_dir, rank)
        assert buckets >= 3, "the bucket size must split stage 0's buffer into several buckets"
        for step, (last_backward, issued) in _steps(run_dir, rank).items():
            assert [r.bucket for r in issued] == list(range(buckets)), f"rank {rank} step {step}"
            for r in issued:
                assert last_backward.start_s < r.issue_s < last_backward.end_s, (
                    f"rank {rank} step {step}: bucket {r.bucket} issued at {r.issue_s:.6f} s, outside the last "
                    f"backward [{last_backward.start_s:.6f}, {last_backward.end_s:.6f}] s")


def test_stage1_issues_its_buckets_after_its_last_backward(run_dir):
    ranks = _ranks_of_stage(run_dir, 1)
    assert len(ranks) == WORLD // PP
    for rank in ranks:
        buckets = _num_grad_buckets(run_dir, rank)
        for step, (last_backward, issued) in _steps(run_dir, rank).items():
            assert [r.bucket for r in issued] == list(range(buckets)), f"rank {rank} step {step}"
            assert all(r.issue_s > last_backward.end_s for r in issued), f"rank {rank} step {step}"
