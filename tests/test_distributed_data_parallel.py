"""DDP over gloo ranks against single-process AdamW, and when its collectives happen.

The reference trains the same model on the whole global batch (every DP rank's micro-batches) in one process: the
loss is the mean over all micro-batches, clipping is torch's clip_grad_norm_, the optimizer torch's AdamW with no
weight decay on biases. DDP must reproduce its losses and parameters to 1e-5 relative over 5 steps.
"""
from __future__ import annotations

import pytest
import torch

from common.config import TrainConfig
from engine.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from tests.support.ddp_toy import MICROBATCHES, STEPS, TRAIN, assert_matches_reference, reference_adamw, train_ranks
from tests.support.gloo import run_distributed

DDP_CONFIGS = [dict(use_distributed_optimizer=False, overlap_grad_reduce=False),
               dict(use_distributed_optimizer=False, overlap_grad_reduce=True)]


@pytest.fixture(scope="module", params=[2, 4], ids=["dp2", "dp4"])
def ddp_runs(request):
    dp = request.param
    return dp, run_distributed(train_ranks, dp, DDP_CONFIGS), reference_adamw(dp, TrainConfig(**TRAIN))


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(DDP_CONFIGS)), ids=["sync", "overlap"])
def test_ddp_equals_single_process_adamw(ddp_runs, index):
    dp, runs, reference = ddp_runs
    for rank_results in runs:
        assert_matches_reference(rank_results[index], reference)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(DDP_CONFIGS)), ids=["sync", "overlap"])
def test_one_all_reduce_per_bucket_group_per_step_after_the_last_microbatch(ddp_runs, index):
    dp, runs, _ = ddp_runs
    result = runs[0][index]
    # Megatron's rule: buckets only with overlap (several here, from the small bucket size); otherwise one.
    overlap = DDP_CONFIGS[index]["overlap_grad_reduce"]
    assert result["groups"] > 1 if overlap else result["groups"] == 1
    begins = [e for e in result["events"] if e[0] == "begin"]
    assert all(name.startswith("all-reduce bucket") for _, name, _ in begins)
    assert len(begins) == STEPS * result["groups"]
    expected_phase = ("microbatch", MICROBATCHES - 1) if overlap else ("finalize",)
    assert {phase for _, _, phase in begins} == {expected_phase}
    per_step = [sum(1 for e in result["events"][:end] if e[0] == "begin") for end in result["step_ends"]]
    assert per_step == [result["groups"] * (s + 1) for s in range(STEPS)]
    assert sum(1 for e in result["events"] if e[0] == "end") == len(begins)


@pytest.mark.slow
def test_a_dp_group_of_one_issues_and_announces_no_collective():
    # Averaging one gradient and gathering a shard that is the whole bucket are identities: nothing moves, so no
    # collective runs and the probes hear of none (the ledger's formulas leave groups of one out too).
    configs = DDP_CONFIGS + [dict(use_distributed_optimizer=True),
                             dict(use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)]
    (results,) = run_distributed(train_ranks, 1, configs)
    reference = reference_adamw(1, TrainConfig(**TRAIN))
    for result in results:
        assert_matches_reference(result, reference)
        assert [e for e in result["events"] if e[0] in ("begin", "end")] == []
    assert results[-1]["groups"] > 1  # several bucket groups, each skipping its own collectives


def _sequence_parallel_grads(rank: int, world_size: int) -> list[float]:
    from engine.parallel_state import ParallelState

    ps = ParallelState.initialize(tp=2)
    norm = torch.nn.Linear(2, 2)
    norm.weight.sequence_parallel = True
    ddp = DistributedDataParallel(DistributedDataParallelConfig(), norm, ps)
    ddp(torch.full((1, 2), float(rank + 1))).sum().backward()  # each TP rank sees its own slice of the sequence
    finalize_model_grads([ddp], ps)
    return norm.weight.main_grad.flatten().tolist() + norm.bias.main_grad.tolist()


@pytest.mark.slow
def test_finalize_sums_sequence_parallel_grads_over_tp_only():
    # d(sum(W x + b))/dW[i, j] = x_j: rank 0 has x = 1, rank 1 has x = 2; the TP sum is 3. The bias is not marked.
    out = run_distributed(_sequence_parallel_grads, 2)
    assert out[0] == out[1][:4] + [1.0, 1.0]
    assert out[0][:4] == [3.0] * 4
