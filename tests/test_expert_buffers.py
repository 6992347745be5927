"""Expert parameters (allreduce False) in DDP, the optimizers and checkpoints, on gloo world 4 with EP 2.

Synthetic model (plumbing, not an MoE layer; tests/test_moe_parity.py tests the real one): a dense Linear shared by
every rank, then one "expert" Linear per EP rank, marked allreduce False, to which every token of the rank goes. On
the expert grid (tp 1, order tp-ep-dp-pp) rank r has ep coordinate r % 2 and expert-dp coordinate r // 2, so expert
e lives on ranks {e, e + 2} (its expt_dp group) and the dense layer on all four (dp 4).

The single-process reference trains dense, expert0 and expert1 on the global batch: the loss is the mean over the
four ranks' micro-batches, each through the expert of its rank's ep coordinate. So expert e's gradient is the sum of
the gradients of the ranks holding it divided by 4 = dp x cp: a sum over expt_dp scaled by 1/(dp x cp), not an
average over expt_dp (that would be twice as large) nor over dp (that would mix the two experts). Clipping is active,
so the grad norm must count each expert once: the norm of all parameters of the reference.

Resharding is checked on the real MoE model (the engine's pretrain), saved at EP 2 and loaded at EP 1.
"""
from __future__ import annotations

import json
from contextlib import nullcontext

import pytest
import torch

from common.arguments import parse_args
from common.config import (
    LATEST_CHECKPOINT_FILE,
    TrainConfig,
    check_load_layout,
    checkpoint_layout,
)
from common.errors import ConfigError
from engine.distributed.distributed_data_parallel_config import DistributedDataParallelConfig
from engine.distributed.param_and_grad_buffer import _ParamAndGradBucket, _ParamAndGradBucketGroup
from probes.probe_set import NullProbeSet
from tests.support.ddp_toy import BUCKET_SIZE, MICROBATCHES, STEPS, TRAIN, microbatch
from tests.support.gloo import run_distributed

WORLD, EP = 4, 2
CONFIGS = [dict(), dict(overlap_grad_reduce=True), dict(use_distributed_optimizer=True),
           dict(use_distributed_optimizer=True, overlap_grad_reduce=True, overlap_param_gather=True)]
IDS = ["ddp", "ddp-overlap", "distopt", "distopt-overlap"]
CHECKPOINT_CONFIG = 3  # the round trip runs under the distributed optimizer with every overlap
MOE_ARGS = ["--model", "tiny", "--num-layers", "2", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--lr", "3e-3", "--mock-data", "--num-experts", "2"]


def _linear(fan_in: int, fan_out: int, seed: int) -> torch.nn.Linear:
    torch.manual_seed(seed)
    return torch.nn.Linear(fan_in, fan_out)


class DenseAndExpert(torch.nn.Module):
    """Synthetic: dense Linear(8, 16), tanh, the expert Linear(16, 4) of one EP rank (allreduce False)."""

    def __init__(self, expert: int):
        super().__init__()
        self.dense = _linear(8, 16, 1234)
        self.expert = _linear(16, 4, 5000 + expert)
        for param in self.expert.parameters():
            param.allreduce = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.expert(torch.tanh(self.dense(x)))


def reference(train: TrainConfig) -> dict:
    dense, experts = _linear(8, 16, 1234), [_linear(16, 4, 5000 + e) for e in range(EP)]
    named = {**{f"dense.{n}": p for n, p in dense.named_parameters()},
             **{f"expert{e}.{n}": p for e, m in enumerate(experts) for n, p in m.named_parameters()}}
    opt = torch.optim.AdamW([{"params": [p for p in named.values() if p.ndim > 1], "weight_decay": train.weight_decay},
                             {"params": [p for p in named.values() if p.ndim == 1], "weight_decay": 0.0}],
                            lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps)
    norms, first_grads = [], {}
    for step in range(STEPS):
        opt.zero_grad()
        for rank in range(WORLD):
            for mb in range(MICROBATCHES):
                x, y = microbatch(step, rank, mb)
                out = experts[rank % EP](torch.tanh(dense(x)))
                (torch.nn.functional.mse_loss(out, y) / (WORLD * MICROBATCHES)).backward()
        if step == 0:
            first_grads = {n: p.grad.clone() for n, p in named.items()}
        norms.append(torch.nn.utils.clip_grad_norm_(list(named.values()), train.clip_grad).item())
        opt.step()
    return {"norms": norms, "first_grads": first_grads, "params": {n: p.detach().clone() for n, p in named.items()}}


def _build(ps, cfg: dict):
    from engine.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )
    from engine.optimizer import get_megatron_optimizer

    train = TrainConfig(ddp_bucket_size=BUCKET_SIZE, **cfg, **TRAIN)
    ddp = DistributedDataParallel(DistributedDataParallelConfig.from_train_config(train, ps.dp_size),
                                  DenseAndExpert(ps.ep_rank), ps)
    return train, ddp, get_megatron_optimizer(train, [ddp], ps)


def _step(ps, ddp, optimizer, step: int) -> float:
    from engine.distributed import finalize_model_grads

    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    for mb in range(MICROBATCHES):
        with ddp.no_sync() if mb < MICROBATCHES - 1 else nullcontext():
            x, y = microbatch(step, ps.dp_rank, mb)
            (torch.nn.functional.mse_loss(ddp(x), y) / MICROBATCHES).backward()
    finalize_model_grads([ddp], ps)
    if step == 0:
        ddp.first_grads = {n: p.main_grad.clone() for n, p in ddp.module.named_parameters()}
    return optimizer.step()[1]


def _params(ddp) -> dict[str, torch.Tensor]:
    ddp.start_param_sync(force_sync=True)
    return {n: p.detach().clone() for n, p in ddp.module.named_parameters()}


def _train_one(ps, cfg: dict) -> dict:
    _, ddp, optimizer = _build(ps, cfg)
    norms = [_step(ps, ddp, optimizer, step) for step in range(STEPS)]
    return {"norms": norms, "params": _params(ddp), "first_grads": ddp.first_grads,
            "inventory": ddp.inventory(),
            "groups": [(g.index, g.attrs, g.dp_size) for g in ddp.bucket_groups],
            "shards": [(b.expert, b.numel, optimizer._shard_bounds(b)) for b in ddp.buffers]}


def _checkpoint_round_trip(ps, directory: str) -> dict:
    """Train to iteration 2 and save; go on one step. A fresh model loads the save and takes the same step."""
    from engine.checkpointing import Checkpointer
    from engine.optimizer import OptimizerParamScheduler

    cfg = parse_args(MOE_ARGS + ["--expert-model-parallel-size", str(EP), "--use-distributed-optimizer",
                                 "--save", directory, "--load", directory], world_size=WORLD)

    class Position:
        position = 0

    def checkpointer():
        train, ddp, optimizer = _build(ps, CONFIGS[CHECKPOINT_CONFIG])
        scheduler = OptimizerParamScheduler(optimizer, train.lr, train.lr, 0.0, 0, STEPS, "constant")
        return ddp, optimizer, Checkpointer(cfg, [ddp], optimizer, scheduler, [Position()], log=False)

    ddp, optimizer, saver = checkpointer()
    for step in range(2):
        _step(ps, ddp, optimizer, step)
    saver.save(2)
    norm = _step(ps, ddp, optimizer, 2)
    expected = _params(ddp)
    ddp, optimizer, loader = checkpointer()
    assert loader.load() == 2
    return {"norms": (norm, _step(ps, ddp, optimizer, 2)), "params": (expected, _params(ddp))}


def expert_ranks(rank: int, world_size: int, directory: str) -> dict:
    from engine.parallel_state import ParallelState

    ps = ParallelState.initialize(ep=EP, moe=True)
    assert (ps.ep_rank, ps.ranks["expt_dp"], ps.ranks["dp_cp"]) == (rank % EP, [rank % EP, rank % EP + EP],
                                                                    list(range(WORLD)))
    return {"runs": [_train_one(ps, cfg) for cfg in CONFIGS], "checkpoint": _checkpoint_round_trip(ps, directory),
            "ep_rank": ps.ep_rank}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    directory = str(tmp_path_factory.mktemp("expert_checkpoint"))
    return run_distributed(expert_ranks, WORLD, directory), reference(TrainConfig(**TRAIN))


def _as_reference(name: str, ep_rank: int) -> str:
    return name.replace("expert.", f"expert{ep_rank}.")


@pytest.mark.slow
def test_expert_grads_are_summed_over_expt_dp_and_scaled_by_one_over_dp_x_cp(runs):
    ranks, ref = runs
    for result in ranks:
        grads = result["runs"][0]["first_grads"]  # without the distributed optimizer every element is reduced
        assert {n for n in grads if n.startswith("expert")} == {"expert.weight", "expert.bias"}
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref["first_grads"][_as_reference(name, result["ep_rank"])],
                                       rtol=1e-5, atol=1e-8, msg=name)


@pytest.mark.slow
@pytest.mark.parametrize("index", range(len(CONFIGS)), ids=IDS)
def test_training_equals_single_process_adamw_with_the_norm_of_every_parameter(runs, index):
    ranks, ref = runs
    for result in ranks:
        run = result["runs"][index]
        torch.testing.assert_close(torch.tensor(run["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=0)
        for name, value in run["params"].items():
            torch.testing.assert_close(value, ref["params"][_as_reference(name, result["ep_rank"])], rtol=1e-5,
                                       atol=1e-7, msg=name)


@pytest.mark.slow
def test_distributed_optimizer_shards_expert_buffers_over_expt_dp(runs):
    ranks, _ = runs
    for rank, result in enumerate(ranks):
        shards = result["runs"][2]["shards"]
        assert [expert for expert, _, _ in shards] == [False, True]  # dense buffers first
        for expert, numel, bounds in shards:
            size, index = (2, rank // EP) if expert else (WORLD, rank)  # expt_dp has 2 ranks, dp x cp 4
            assert numel % size == 0
            assert bounds == [(index * numel // size, (index + 1) * numel // size)]  # one bucket without overlap


@pytest.mark.slow
def test_expert_buffers_and_buckets_are_named_apart(runs):
    ranks, _ = runs
    inventory = ranks[0]["runs"][0]["inventory"]
    assert [(r["name"], r.get("expert")) for r in inventory] == [
        ("ddp.buffer0.param_data", None), ("ddp.buffer0.grad_data", None),
        ("ddp.expert_buffer0.param_data", True), ("ddp.expert_buffer0.grad_data", True)]
    assert inventory[2]["numel"] == 16 * 4 + 4  # no padding without the distributed optimizer
    groups = ranks[0]["runs"][1]["groups"]  # overlap: buckets of BUCKET_SIZE, numbered dense first
    dense = [g for g in groups if "expert" not in g[1]]
    expert = [g for g in groups if g[1].get("expert")]
    assert [g[0] for g in groups] == list(range(len(groups))) and groups == dense + expert
    assert {g[2] for g in dense} == {WORLD} and {g[2] for g in expert} == {2}


@pytest.mark.slow
def test_checkpoint_round_trip_of_expert_buffers_is_bit_exact(runs):
    ranks, _ = runs
    for result in ranks:
        (norm, resumed_norm), (expected, resumed) = result["checkpoint"]["norms"], result["checkpoint"]["params"]
        assert norm == resumed_norm
        for name, value in expected.items():
            assert torch.equal(value, resumed[name]), name


def test_a_model_without_expert_parameters_builds_what_it_built_before():
    """No expert buffer, record or probe attribute; expert parameters without the expert groups are refused."""
    from engine.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )
    from engine.parallel_state import ParallelState
    from tests.support.gloo import world_of_one

    with world_of_one():
        ps = ParallelState.initialize()
        config = DistributedDataParallelConfig(overlap_grad_reduce=True, bucket_size=100)
        dense = DistributedDataParallel(config, torch.nn.Sequential(_linear(8, 16, 1), _linear(16, 4, 2)), ps)
        assert [b.expert for b in dense.buffers] == [False]
        assert all("expert" not in r and r["name"].startswith("ddp.buffer0.") for r in dense.inventory())
        assert [g.attrs for g in dense.bucket_groups] == [{"bucket": i} for i in range(len(dense.bucket_groups))]
        with pytest.raises(ValueError, match="need the expert groups"):
            DistributedDataParallel(config, DenseAndExpert(0), ps)


# --- a real MoE model's checkpoint at another EP / expert-DP layout ------------------------------------------------
RESHARD_ARGS = ["--model", "tiny", "--num-layers", "2", "--micro-batch-size", "1", "--global-batch-size", "4",
                "--lr", "3e-3", "--lr-warmup-iters", "1", "--mock-data", "--train-iters", "6", "--num-experts", "4",
                "--use-distributed-optimizer"]


def moe_run(rank: int, world_size: int, argv: list[str]) -> dict:
    """pretrain of the MoE model with these flags: its losses, and every parameter this rank holds (by global name)
    right after the checkpoint load and right before the first save."""
    from unittest import mock

    from engine import checkpointing
    from engine.parallel_state import ParallelState
    from engine.training import pretrain
    from tests.support.parity import full_parameters

    cfg = parse_args(argv, world_size=world_size)
    ps = ParallelState.from_run_config(cfg)
    captured: dict = {}
    real_load, real_save = checkpointing.Checkpointer.load, checkpointing.Checkpointer.save

    def load(self):
        iteration = real_load(self)
        captured["loaded"] = {n: v.clone() for n, v in full_parameters(self.model, ps).items()}
        return iteration

    def save(self, iteration):
        captured.setdefault("saved", {n: v.clone() for n, v in full_parameters(self.model, ps).items()})
        real_save(self, iteration)

    with mock.patch.object(checkpointing.Checkpointer, "load", load), \
            mock.patch.object(checkpointing.Checkpointer, "save", save):
        result = pretrain(cfg, ps, torch.device("cpu"))
    return {**captured, "losses": [s.loss for s in result.steps]}


def _moe_run(world_size: int, argv: list[str]) -> dict:
    """The losses, and each moment's parameters merged over the ranks (each EP rank holds its own experts)."""
    ranks = run_distributed(moe_run, world_size, argv)
    return {"losses": ranks[0]["losses"],
            **{moment: {n: v for rank in ranks for n, v in rank[moment].items()}
               for moment in ("saved", "loaded") if moment in ranks[0]}}


@pytest.fixture(scope="module")
def moe_ep2_checkpoint(tmp_path_factory):
    """The straight run at world 2, EP 2 (expert-DP 1), 6 steps, saving after 3; pointed at iteration 3."""
    save_dir = tmp_path_factory.mktemp("moe_ckpt")
    straight = _moe_run(2, RESHARD_ARGS + ["--expert-model-parallel-size", "2", "--save", str(save_dir),
                                           "--save-interval", "3"])
    (save_dir / LATEST_CHECKPOINT_FILE).write_text("3\n")
    return str(save_dir), straight


@pytest.mark.slow
@pytest.mark.parametrize("world, ep", [(1, 1), (2, 1)], ids=["ep2 -> ep1 world 1", "ep2 -> ep1 expert-dp 2"])
def test_an_moe_checkpoint_reshards_across_ep_and_expert_dp(moe_ep2_checkpoint, world, ep):
    """Every expert lands on the rank that holds it at the new layout with its saved value, and training goes on as
    the saving layout did (Adam's moments and the expert buffers' optimizer shards included) to 1e-5."""
    from tests.support.parity import assert_close_rel

    save_dir, straight = moe_ep2_checkpoint
    resumed = _moe_run(world, RESHARD_ARGS + ["--expert-model-parallel-size", str(ep), "--load", save_dir])
    assert resumed["loaded"].keys() == straight["saved"].keys()
    assert sum(".mlp.experts." in name for name in resumed["loaded"]) == 2 * 4 * 2  # layers x experts x fc1, fc2
    for name, value in straight["saved"].items():
        assert torch.equal(resumed["loaded"][name], value), name
    assert_close_rel(resumed["losses"], straight["losses"][3:], "losses after the load", 1e-5)


def _saved_layout(directory, argv: list[str], world_size: int, drop: tuple[str, ...] = ()) -> None:
    """A checkpoint directory's metadata only (synthetic: the layout check reads nothing else)."""
    (directory / "iter_0000003").mkdir(parents=True)
    layout = {k: v for k, v in checkpoint_layout(parse_args(argv, world_size=world_size)).items() if k not in drop}
    (directory / "iter_0000003" / "layout.json").write_text(json.dumps(layout))
    (directory / LATEST_CHECKPOINT_FILE).write_text("3\n")


def test_an_moe_checkpoint_loads_at_another_ep_but_not_with_other_experts(tmp_path):
    _saved_layout(tmp_path, MOE_ARGS + ["--expert-model-parallel-size", "2"], world_size=4)
    for flags, world in [(["--expert-model-parallel-size", "2"], 4), (["--expert-model-parallel-size", "1"], 4),
                         (["--expert-model-parallel-size", "2"], 8)]:  # the same, EP, expert-DP: engine reshards
        parse_args(MOE_ARGS + flags + ["--load", str(tmp_path)], world_size=world)
    for flags, what in [(["--num-experts", "4"], "num_experts 2, this run has 4"),
                        (["--moe-ffn-hidden-size", "32"], "moe_ffn_hidden_size 176, this run has 32")]:
        with pytest.raises(ConfigError, match=rf"^--load .*: iter_0000003 was saved with {what};[^\n]*$"):
            parse_args(MOE_ARGS + flags + ["--load", str(tmp_path)], world_size=4)


def test_layout_records_experts_and_older_dense_layouts_still_load(tmp_path):
    moe = checkpoint_layout(parse_args(MOE_ARGS + ["--expert-model-parallel-size", "2"], world_size=4))
    assert (moe["num_experts"], moe["expert_model_parallel_size"]) == (2, 2)
    dense = MOE_ARGS[:-2]  # without --num-experts 2
    _saved_layout(tmp_path, dense, world_size=1, drop=("num_experts", "expert_model_parallel_size"))
    cfg = parse_args(dense, world_size=1)
    cfg.checkpoint.load = str(tmp_path)
    check_load_layout(cfg)  # a layout.json from before the MoE keys: a dense checkpoint
    with pytest.raises(ConfigError, match="num_experts None, this run has 2"):
        parse_args(MOE_ARGS + ["--load", str(tmp_path)], world_size=1)


class _OneRank:
    """A data-parallel group of one rank, which a bucket group asks only for its size and rank."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0


@pytest.mark.parametrize("factor", [1.0, 0.5])
def test_an_expert_bucket_is_scaled_before_its_reduction_unless_the_factor_is_one(factor):
    """1/(dp x cp) = 1 (one rank, no CP) would read and write every expert gradient for nothing: 22.5 GB a step on
    mixtral-8x7b-2l. Megatron's start_grad_sync skips it; so does the engine, and any other factor still scales."""
    param = torch.nn.Parameter(torch.zeros(8))
    bucket = _ParamAndGradBucket([param], torch.zeros(8), torch.arange(8.0), offset=0, bucket_id=0)
    group = _ParamAndGradBucketGroup([bucket], DistributedDataParallelConfig(), _OneRank(), 0, NullProbeSet(),
                                     gradient_scaling_factor=factor)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        group.start_grad_sync()
    muls = [e for e in prof.events() if e.name in ("aten::mul_", "aten::mul")]
    assert bool(muls) == (factor != 1.0)
    torch.testing.assert_close(bucket.grad_data, torch.arange(8.0) * factor)
