"""The distributed optimizer (ZeRO-1) against single-process AdamW; its collectives; TP x DP; bf16; what the optimizers
allocate and when, against the ledger's static-memory formula; the scheduler."""
from __future__ import annotations

import math

import pytest
import torch

from common.arguments import parse_args
from common.config import TrainConfig
from common.errors import ConfigError
from engine.optimizer import OptimizerParamScheduler
from engine.tensor_parallel.mappings import (
    TPGroup,
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)
from tests.support.ddp_toy import (
    MICROBATCHES,
    STEPS,
    TRAIN,
    assert_matches_reference,
    make_model,
    reference_adamw,
    train_ranks,
)
from tests.support.gloo import run_distributed
from tests.support.records import typed

DIST_CONFIGS = [dict(use_distributed_optimizer=True),
                dict(use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)]
# With dist opt and bucket_size 100 the 484-element model lays out (reverse order, starts to 64, ends to 128):
# bucket 0 = layer "4" [0, 128), bucket 1 = layer "2" [128, 512), bucket 2 = layer "0" [512, 768).
GROUPS = 3


@pytest.fixture(scope="module", params=[2, 4], ids=["dp2", "dp4"])
def dist_runs(request):
    dp = request.param
    return dp, run_distributed(train_ranks, dp, DIST_CONFIGS), reference_adamw(dp, TrainConfig(**TRAIN))


@pytest.mark.slow
@pytest.mark.parametrize("index", [0, 1], ids=["sync", "overlap"])
def test_distributed_optimizer_equals_single_process_adamw(dist_runs, index):
    _, runs, reference = dist_runs
    for rank_results in runs:
        assert_matches_reference(rank_results[index], reference)


def _phases(result: dict, kind: str) -> list[tuple]:
    return [phase for what, name, phase in result["events"] if what == "begin" and name.startswith(kind)]


@pytest.mark.slow
def test_sync_collectives_once_per_step_per_bucket_group(dist_runs):
    _, runs, _ = dist_runs
    result = runs[0][0]
    assert result["groups"] == 1  # no overlap: one bucket, Megatron's rule
    assert _phases(result, "reduce-scatter") == [("finalize",)] * STEPS
    assert _phases(result, "all-gather") == [("step",)] * STEPS  # synchronous, inside optimizer.step()
    assert not _phases(result, "all-reduce")


@pytest.mark.slow
def test_overlapped_collectives_once_per_step_per_bucket_group(dist_runs):
    _, runs, _ = dist_runs
    result = runs[0][1]
    assert result["groups"] == GROUPS
    # Reduce-scatters start inside the last micro-batch's backward, one per bucket group per step.
    assert _phases(result, "reduce-scatter") == [("microbatch", MICROBATCHES - 1)] * GROUPS * STEPS
    # All-gathers of step s's update: the first in the next zero_grad, the rest during micro-batch 0's forward;
    # the last update's are forced after the loop. Nothing in step 0 (the model starts replicated).
    per_step = [("zero_grad",)] + [("microbatch", 0)] * (GROUPS - 1)
    assert _phases(result, "all-gather") == per_step * (STEPS - 1) + [("final",)] * GROUPS
    begins = sum(1 for e in result["events"] if e[0] == "begin")
    assert begins == sum(1 for e in result["events"] if e[0] == "end")


@pytest.mark.slow
def test_forward_pre_hooks_wait_only_for_their_own_bucket(dist_runs):
    _, runs, _ = dist_runs
    result = runs[0][1]
    start = result["step_ends"][0]  # step 1: the first step with a gather owed
    seen = [(what, name) for what, name, _ in result["events"][start:]
            if (what == "forward" and name in ("0", "2", "4")) or name.startswith("all-gather")]
    # The test's marker hook runs just before DDP's pre-hook on the same module.
    assert seen[:9] == [("begin", "all-gather bucket2"),  # optimizer.zero_grad()
                        ("forward", "0"), ("end", "all-gather bucket2"), ("begin", "all-gather bucket1"),
                        ("forward", "2"), ("end", "all-gather bucket1"), ("begin", "all-gather bucket0"),
                        ("forward", "4"), ("end", "all-gather bucket0")]


@pytest.mark.slow
def test_a_pre_hook_that_waits_for_its_all_gather_opens_a_dp_wait_range(dist_runs):
    # The wait is a range of its own around each owed all-gather's end, so the ledger can cut it out of the forward's
    # compute: a forward stalled on its all-gather is not that all-gather's overlap. Without overlap nothing waits.
    _, runs, _ = dist_runs
    overlapped, sync = runs[0][1], runs[0][0]
    start = overlapped["step_ends"][0]
    seen = [(what, name) for what, name, _ in overlapped["events"][start:] if what in ("dp-wait", "end")]
    assert seen[:6] == [("dp-wait", "wait all-gather bucket2"), ("end", "all-gather bucket2"),
                        ("dp-wait", "wait all-gather bucket1"), ("end", "all-gather bucket1"),
                        ("dp-wait", "wait all-gather bucket0"), ("end", "all-gather bucket0")]
    assert not [e for e in overlapped["events"][:start] + sync["events"] if e[0] == "dp-wait"]  # nothing owed


@pytest.mark.slow
def test_master_and_adam_state_exist_only_for_the_shard(dist_runs):
    dp, runs, _ = dist_runs
    before, after = runs[0][0]["inventories"]
    # fp32 model: the master params are the param buffer's shard itself, so no master copy is allocated.
    assert [r["kind"] for r in before] == ["adam_exp_avg", "adam_exp_avg_sq"]
    assert [r["exists"] for r in before] == [False, False] and [r["exists"] for r in after] == [True, True]
    owned = [r["numel"] for rank in runs for r in rank[0]["inventories"][0] if r["kind"] == "adam_exp_avg"]
    assert sum(owned) == 484  # the shards partition the model's 484 elements
    (grad_buffer,) = [r for r in runs[0][0]["ddp_inventory"] if r["kind"] == "grad_buffer"]
    # One bucket (no overlap): 4.bias [0,4) 4.weight [64,128) 2.bias [128,144) 2.weight [192,448)
    # 0.bias [448,464) 0.weight [512,640); 640 is already a multiple of lcm(dp, 128).
    assert grad_buffer["numel"] == 640 and grad_buffer["padding"] == 640 - 484


# -- TP=2 x DP=2 --------------------------------------------------------------------------------------------------
class TensorParallelMLP(torch.nn.Module):
    """make_model() with layer 2 column-parallel and layer 4 row-parallel; layer 0 and the last bias replicated."""

    def __init__(self, ps):
        super().__init__()
        full, t, half = make_model(), ps.tp_rank, 8
        self.tp = TPGroup.from_parallel_state(ps)
        self.l0 = full[0]
        self.w1 = torch.nn.Parameter(full[2].weight.detach()[t * half:(t + 1) * half].clone())
        self.b1 = torch.nn.Parameter(full[2].bias.detach()[t * half:(t + 1) * half].clone())
        self.w2 = torch.nn.Parameter(full[4].weight.detach()[:, t * half:(t + 1) * half].clone())
        self.b2 = torch.nn.Parameter(full[4].bias.detach().clone())
        for sharded in (self.w1, self.b1, self.w2):
            sharded.tensor_model_parallel = True

    def forward(self, x):
        h = copy_to_tensor_model_parallel_region(torch.tanh(self.l0(x)), self.tp)
        h = torch.tanh(h @ self.w1.t() + self.b1)
        return reduce_from_tensor_model_parallel_region(h @ self.w2.t(), self.tp) + self.b2


def build_tensor_parallel(ps) -> torch.nn.Module:
    return TensorParallelMLP(ps)


@pytest.mark.slow
def test_tp2_dp2_distributed_optimizer_counts_tp_duplicates_once():
    runs = run_distributed(train_ranks, 4, [DIST_CONFIGS[1]], 2, build_tensor_parallel)
    reference = reference_adamw(2, TrainConfig(**TRAIN))
    by_tp = {r[0]["ranks"]: r[0] for r in runs}
    for dp in range(2):
        shards = [by_tp[(t, dp)]["params"] for t in range(2)]
        assembled = {"0.weight": shards[0]["l0.weight"], "0.bias": shards[0]["l0.bias"],
                     "2.weight": torch.cat([s["w1"] for s in shards]), "2.bias": torch.cat([s["b1"] for s in shards]),
                     "4.weight": torch.cat([s["w2"] for s in shards], dim=1), "4.bias": shards[0]["b2"]}
        for t in range(2):
            assert_matches_reference({**by_tp[(t, dp)], "params": assembled}, reference)
            for name in ("l0.weight", "l0.bias", "b2"):
                torch.testing.assert_close(by_tp[(t, dp)]["params"][name], shards[0][name], rtol=0, atol=0)
    assert min(reference["norms"]) > TRAIN["clip_grad"]  # clipping, hence the norm, shaped every update


# -- bf16 ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_bf16_mixed_precision_keeps_fp32_masters_and_tracks_fp32_training():
    configs = [dict(use_distributed_optimizer=False, bf16=True), dict(use_distributed_optimizer=True, bf16=True)]
    runs = run_distributed(train_ranks, 2, configs)
    reference = reference_adamw(2, TrainConfig(**TRAIN))
    float16, distributed = runs[0]
    for result in (float16, distributed):
        assert_matches_reference(result, reference, rtol=3e-2, atol=2e-2)  # bf16 rounding of params and activations
    # Both update the same fp32 masters from the same fp32 grads: they agree far better than with fp32 training.
    for name, value in float16["params"].items():
        torch.testing.assert_close(distributed["params"][name], value, rtol=0, atol=1e-6)
    masters = {o["kind"]: o for o in float16["inventories"][0]}["master_params"]
    assert (masters["numel"], masters["bytes"], masters["padding"]) == (484, 4 * 484, 0)
    # Each rank owns half of the 640-element buffer (layout in test_master_and_adam_state_exist_only_for_the_shard):
    # rank 0 [0, 320): 4.bias 4, 4.weight 64, 2.bias 16, 2.weight [192, 320) 128; rank 1 the rest of 2.weight 128,
    # 0.bias 16, 0.weight 128. Masters exist for those parameter elements only, never for padding (as Megatron).
    shard_masters = [{o["kind"]: o for o in r[1]["inventories"][0]}["master_params"] for r in runs]
    assert [(m["numel"], m["padding"]) for m in shard_masters] == [(4 + 64 + 16 + 128, 0), (128 + 16 + 128, 0)]


# -- allocations against the formula ------------------------------------------------------------------------------
# tiny, tied, one stage: 4 layers of 2 norms (64), QKV (8 + 2 x 4) x 8 x 64, proj 64 x 64, fc1 352 x 64, fc2 64 x 176,
# the 1000 x 64 embedding and the final norm: every tensor a multiple of 64 elements.
TINY_NUMEL = 4 * (2 * 64 + 128 * 64 + 64 * 64 + 352 * 64 + 64 * 176) + 1000 * 64 + 64
STATIC_ROWS = ("memory.static_after_optimizer_init", "memory.static_after_first_step", "memory.adam_lazy_state")


def _train_one_step_on_a_world_of_one(flags: list[str]) -> tuple[list[dict], list[dict], dict]:
    """The engine's inventory after optimizer construction and after one training step, and the optimizer's fp32
    grad copy (None or its numel) before the step, after it, and after the next zero_grad."""
    from engine.data import build_data_iterators
    from engine.model_builder import get_model
    from engine.optimizer import get_megatron_optimizer
    from engine.parallel_state import ParallelState
    from engine.training import build_schedule_config, forward_step, train_step
    from probes.probe_set import NullProbeSet
    from tests.support.gloo import world_of_one

    run_config = parse_args(["--model", "tiny", "--global-batch-size", "2", "--train-iters", "1", "--mock-data",
                             *flags], world_size=1)
    device, probes = torch.device("cpu"), NullProbeSet()
    with world_of_one():
        ps = ParallelState.initialize()
        model = get_model(run_config, ps, device, probes)
        optimizer = get_megatron_optimizer(run_config.train, model, ps)
        copies = {"init": optimizer.main_grad_storage}
        init = [r for chunk in model for r in chunk.inventory()] + optimizer.inventory()
        train_step(forward_step, build_data_iterators(run_config, ps, device), model, optimizer,
                   OptimizerParamScheduler.from_train_config(optimizer, run_config.train),
                   build_schedule_config(run_config, model, ps, probes), run_config, ps, device)
        copies["stepped"] = optimizer.main_grad_storage
        stepped = [r for chunk in model for r in chunk.inventory()] + optimizer.inventory()
        optimizer.zero_grad()
        copies["zero_grad"] = optimizer.main_grad_storage
    return init, stepped, {k: None if v is None else v.numel() for k, v in copies.items()}


@pytest.mark.parametrize("flags", [["--bf16", "--grad-reduce-in-bf16"], ["--bf16", "--use-distributed-optimizer"],
                                   ["--bf16", "--use-distributed-optimizer", "--grad-reduce-in-bf16"]],
                         ids=["bf16-grads", "distopt", "distopt-bf16-grads"])
def test_optimizer_allocations_equal_the_static_memory_formula_to_the_byte(flags):
    """Megatron allocates the fp32 copy of a 16-bit main grad at step time (_copy_model_grads_to_main_grads) and
    frees it at zero_grad; it keeps fp32 main params for parameter elements only, never for bucket padding. The
    engine's inventory must then equal the formula in both phases, to the byte, not within a tolerance."""
    from ledger.evidence.run import RankEvidence
    from ledger.reconcile.memory import rank_rows

    init, stepped, copies = _train_one_step_on_a_world_of_one(flags)
    (grad_buffer,) = [r for r in init if r["kind"] == "grad_buffer"]
    if "--use-distributed-optimizer" in flags:  # one bucket, its end padded to a multiple of lcm(1, 128)
        assert (grad_buffer["numel"], grad_buffer["padding"]) == (math.ceil(TINY_NUMEL / 128) * 128, 64)
    masters = {r["kind"]: r for r in init}["master_params"]
    assert (masters["numel"], masters["padding"]) == (TINY_NUMEL, 0)
    if "--grad-reduce-in-bf16" in flags:
        assert copies == {"init": None, "stepped": TINY_NUMEL, "zero_grad": None}
    cfg = parse_args(["--model", "tiny", "--global-batch-size", "2", *flags], world_size=1)
    coords = {"tp": 0, "pp": 0, "dp": 0, "cp": 0}
    for inventory in (init, stepped):  # the inventory's allocated_at, not the moment it was taken, sorts it
        evidence = RankEvidence(rank=0, coords=coords, inventory=typed("inventory", inventory))
        rows = {r.metric: r for r in rank_rows(cfg, evidence)}
        for metric in STATIC_ROWS:
            assert rows[metric].inventory == rows[metric].predicted, metric


# -- OptimizerParamScheduler --------------------------------------------------------------------------------------
class _Groups:
    def __init__(self):
        self.param_groups = [{"lr": None}, {"lr": None}]


def test_scheduler_warmup_then_cosine_to_min_lr():
    opt = _Groups()
    sched = OptimizerParamScheduler(opt, init_lr=0.0, max_lr=3e-4, min_lr=3e-5, lr_warmup_steps=10,
                                    lr_decay_steps=50, lr_decay_style="cosine")
    assert opt.param_groups[0]["lr"] == 0.0  # Megatron applies step 0 at construction
    lrs = [sched.step() for _ in range(60)]
    assert lrs[4] == pytest.approx(3e-4 * 5 / 10)
    assert lrs[9] == pytest.approx(3e-4)
    # halfway through decay (step 30 of 10..50): coeff = (cos(pi/2) + 1) / 2 = 1/2
    assert lrs[29] == pytest.approx(3e-5 + 0.5 * (3e-4 - 3e-5))
    assert lrs[49] == pytest.approx(3e-5) and lrs[59] == 3e-5
    assert [g["lr"] for g in opt.param_groups] == [3e-5, 3e-5]


def test_scheduler_linear_and_constant():
    linear = OptimizerParamScheduler(_Groups(), 0.0, 1.0, 0.0, 0, 4, "linear")
    assert [linear.step() for _ in range(5)] == [0.75, 0.5, 0.25, 0.0, 0.0]
    constant = OptimizerParamScheduler(_Groups(), 0.0, 1.0, 0.5, 2, 4, "constant")
    assert [constant.step() for _ in range(4)] == [0.5, 1.0, 1.0, 1.0]


def test_scheduler_from_train_config_decays_over_train_iters_and_rejects_bad_values():
    sched = OptimizerParamScheduler.from_train_config(_Groups(), TrainConfig(lr=1.0, train_iters=4,
                                                                             lr_decay_style="cosine"))
    assert [sched.step() for _ in range(4)] == pytest.approx([0.5 * (math.cos(math.pi * k / 4) + 1)
                                                              for k in range(1, 5)])
    with pytest.raises(ConfigError, match="--min-lr"):
        OptimizerParamScheduler(_Groups(), 0.0, 1.0, 2.0, 0, 4, "cosine")
    with pytest.raises(ConfigError, match="--lr-warmup-iters"):
        OptimizerParamScheduler(_Groups(), 0.0, 1.0, 0.0, 4, 4, "cosine")
