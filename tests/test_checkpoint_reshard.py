"""Resharding (engine/checkpoint_reshard.py): a checkpoint saved at one parallel layout loads at another.

What must hold, from first principles:
- every piece of state is a copy, so right after the load each parameter's value, fp32 main param, Adam m and v and
  Adam step equal the saved ones exactly, parameter by parameter, by global name (read off the live objects of both
  runs by this file's own walk over the optimizer's pieces, not through the module under test); vocabulary padding
  rows, whose number depends on the TP size, are zero on both sides;
- the data order is global and nothing else carries state, so the run continues as the saving layout continues:
  each later loss equals the straight run's to 1e-5 relative (a new layout changes only the fp32 summation order),
  which also checks what the state comparison cannot: that each TP rank's cut (whole query groups with their K and
  V, [gate_r; up_r] of fc1, its rows of the padded vocabulary) is the one its forward computes with;
- model shape stays refused: one line, exit 2.
"""
from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from common.arguments import parse_args
from common.config import LATEST_CHECKPOINT_FILE, checkpoint_layout
from common.errors import ConfigError
from engine import checkpointing
from engine.checkpoint_reshard import resharding_note, unpartition
from engine.parallel_state import ParallelState
from engine.tensor_parallel.random import partition
from engine.training import pretrain
from tests.support.gloo import run_distributed, world_of_one
from tests.support.parity import (
    TIED_EMBEDDING,
    _global_name,
    assert_close_rel,
    full_parameters,
)

TINY = ["--model", "tiny", "--num-layers", "2", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--lr", "3e-3", "--lr-warmup-iters", "1", "--mock-data", "--train-iters", "6"]
KINDS = ("main_param", "exp_avg", "exp_avg_sq")


# --- the full state by name, read off a live run -------------------------------------------------------------------

def _owner(piece: torch.Tensor, model: list[Any]) -> tuple[str, torch.nn.Parameter]:
    """The parameter whose storage range holds an optimizer piece (a view into a DDP param buffer), by name."""
    for chunk in model:
        for name, param in chunk.module.named_parameters():
            same = param.data.untyped_storage().data_ptr() == piece.untyped_storage().data_ptr()
            offset = piece.storage_offset() - param.data.storage_offset()
            if same and 0 <= offset < param.numel():
                name = TIED_EMBEDDING if getattr(param, "shared", False) else _global_name(name, chunk.module)
                return name, param
    raise AssertionError("an optimizer piece outside every parameter")


def _gather_tp(value: torch.Tensor, param: torch.nn.Parameter, ps: ParallelState) -> torch.Tensor:
    if not getattr(param, "tensor_model_parallel", False) or ps.tp_size == 1:
        return value
    shards = [torch.empty_like(value) for _ in range(ps.tp_size)]
    dist.all_gather(shards, value, group=ps.groups["tp"])
    parts = [shard.chunk(param.partition_stride, dim=param.partition_dim) for shard in shards]
    return torch.cat([parts[r][s] for s in range(param.partition_stride) for r in range(ps.tp_size)],
                     dim=param.partition_dim)


def full_state(model: list[Any], optimizer: Any, ps: ParallelState) -> dict[str, Any]:
    """Params, fp32 main params, Adam m and v, full by global name, and Adam's step. Collective: each rank fills its
    optimizer pieces into zeros, the distributed optimizer's DP ranks sum their disjoint pieces, TP shards are
    gathered."""
    # A snapshot: full_parameters hands out the live fp32 CPU parameters themselves where there is nothing to gather.
    state: dict[str, Any] = {"param": {n: v.clone() for n, v in full_parameters(model, ps).items()}, "step": set()}
    params = {TIED_EMBEDDING if getattr(param, "shared", False) else _global_name(name, chunk.module): param
              for chunk in model for name, param in chunk.module.named_parameters()}
    local = {kind: {name: torch.zeros(param.numel()) for name, param in params.items()} for kind in KINDS}
    for piece, main in zip(optimizer.model_params, optimizer.main_params):
        name, param = _owner(piece, model)
        start = piece.storage_offset() - param.data.storage_offset()
        adam = optimizer.optimizer.state.get(main, {})  # empty before the first step
        state["step"] |= {float(adam["step"])} if adam else set()
        for kind, value in (("main_param", main), *((k, adam[k]) for k in ("exp_avg", "exp_avg_sq") if adam)):
            local[kind][name][start:start + piece.numel()] = value.detach().float()
    for kind in KINDS:
        state[kind] = {}
        for name in sorted(local[kind]):  # the same order on every rank of a collective
            flat = local[kind][name]
            if optimizer.train.use_distributed_optimizer and ps.groups["dp_cp"].size() > 1:
                dist.all_reduce(flat, group=ps.groups["dp_cp"])
            state[kind][name] = _gather_tp(flat.view(params[name].shape), params[name], ps)
    return state


def run_and_capture(rank: int, world_size: int, argv: list[str]) -> dict[str, Any]:
    """pretrain with these flags: the losses, and the full state right after the checkpoint load ("loaded", under
    --load) and right before the first save ("saved", under --save)."""
    cfg = parse_args(argv, world_size=world_size)
    p = cfg.parallel
    ps = ParallelState.initialize(p.tensor_model_parallel_size, p.pipeline_model_parallel_size,
                                  p.context_parallel_size, p.order, p.virtual_pipeline_model_parallel_size)
    captured: dict[str, Any] = {}
    real_load, real_save = checkpointing.Checkpointer.load, checkpointing.Checkpointer.save

    def load(self):
        iteration = real_load(self)
        if self.loaded_iteration is not None:
            captured["loaded"] = full_state(self.model, self.optimizer, ps)
            captured["loaded_scheduler_steps"] = self.scheduler.num_steps
        return iteration

    def save(self, iteration):
        if "saved" not in captured:
            captured["saved"] = full_state(self.model, self.optimizer, ps)
            captured["saved_scheduler_steps"] = self.scheduler.num_steps
        real_save(self, iteration)

    with mock.patch.object(checkpointing.Checkpointer, "load", load), \
            mock.patch.object(checkpointing.Checkpointer, "save", save):
        result = pretrain(cfg, ps, torch.device("cpu"))
    return {**captured, "losses": [s.loss for s in result.steps]}


def _run(world_size: int, argv: list[str]) -> dict[str, Any]:
    """The last rank's losses, and the full state of the whole model: every rank holds its pipeline stage's whole
    after the gathers, so the ranks' states are merged by name."""
    if world_size == 1:
        with world_of_one():
            return run_and_capture(0, 1, argv)
    ranks = run_distributed(run_and_capture, world_size, argv)
    merged = dict(ranks[-1])
    for moment in ("saved", "loaded"):
        if moment in merged:
            merged[moment] = {kind: {name: value for rank in ranks for name, value in rank[moment][kind].items()}
                              for kind in ("param", *KINDS)}
            merged[moment]["step"] = set().union(*(rank[moment]["step"] for rank in ranks))
    return merged


def _assert_same_state(loaded: dict[str, Any], saved: dict[str, Any]) -> None:
    assert loaded["step"] == saved["step"] and len(saved["step"]) == 1, (loaded["step"], saved["step"])
    for kind in ("param", *KINDS):
        assert loaded[kind].keys() == saved[kind].keys(), kind
        for name, expected in saved[kind].items():
            actual = loaded[kind][name]
            rows = min(actual.shape[0], expected.shape[0])  # the vocabulary padding depends on the TP size
            assert torch.equal(actual[:rows], expected[:rows]), (kind, name)
            assert not actual[rows:].any() and not expected[rows:].any(), (kind, name)


# --- save at one layout, load at another ---------------------------------------------------------------------------

TP2, PP2 = ["--tensor-model-parallel-size", "2"], ["--pipeline-model-parallel-size", "2"]
DISTOPT = ["--use-distributed-optimizer"]
# (saving world, its flags, loading world, its flags); the rest as TINY. bf16 only where the layouts compute the
# forward alike: a TP change moves bf16 roundings (partial sums of the row-parallel GEMMs), ~1e-5 of the loss.
CASES = {
    "dp2 -> dp1, distributed optimizer, bf16": (2, DISTOPT + ["--bf16"], 1, DISTOPT + ["--bf16"]),
    "dp1 -> dp2, distributed optimizer": (1, DISTOPT, 2, DISTOPT),
    "dp2 -> dp1, bf16": (2, ["--bf16"], 1, ["--bf16"]),
    "tp2 -> tp1, distributed optimizer": (2, TP2 + DISTOPT, 1, DISTOPT),
    "tp1 -> tp2": (1, [], 2, TP2),
    "pp2 -> pp1, tied embeddings": (2, PP2, 1, []),
    "pp1 -> pp2, tied embeddings": (1, [], 2, PP2),  # the last stage's copy from the embedding's state
    "pp2 x vpp2 -> tp2": (2, PP2 + ["--virtual-pipeline-model-parallel-size", "2", "--num-layers", "4"],
                          2, TP2 + ["--num-layers", "4"]),
    # uneven stages of 1, 2, 1 layers (each saved rank's layers found by the split layout.json records)
    "pp3 uneven -> pp2": (3, ["--pipeline-model-parallel-size", "3", "--num-layers", "4",
                              "--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "1"],
                          2, PP2 + ["--num-layers", "4"]),
}


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Callable[[int, list[str]], tuple[str, dict[str, Any]]]:
    """saved(world, flags): the straight run at a saving layout (6 steps, saving after 3) and its checkpoint
    directory, pointed at iteration 3. Run once per layout: cases that save at the same layout share it (a load
    reads the checkpoint and writes nothing there)."""
    runs: dict[tuple[int, tuple[str, ...]], tuple[str, dict[str, Any]]] = {}

    def run(world: int, flags: list[str]) -> tuple[str, dict[str, Any]]:
        if (world, tuple(flags)) not in runs:
            save_dir = tmp_path_factory.mktemp("ckpt")
            straight = _run(world, TINY + flags + ["--save", str(save_dir), "--save-interval", "3"])
            (save_dir / LATEST_CHECKPOINT_FILE).write_text("3\n")  # resume from iteration 3, not 6
            runs[world, tuple(flags)] = str(save_dir), straight
        return runs[world, tuple(flags)]
    return run


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_a_resharded_checkpoint_holds_the_saved_state_and_training_continues(case, saved):
    """6 steps at the saving layout, saving after 3; then --load at the new layout and 3 more steps."""
    save_world, save_flags, load_world, load_flags = CASES[case]
    save_dir, straight = saved(save_world, save_flags)
    resumed = _run(load_world, TINY + load_flags + ["--load", save_dir])
    _assert_same_state(resumed["loaded"], straight["saved"])
    assert resumed["loaded_scheduler_steps"] == straight["saved_scheduler_steps"] > 0
    assert len(resumed["losses"]) == 3
    assert_close_rel(resumed["losses"], straight["losses"][3:], f"{case}: losses after the load", 1e-5)


# --- what stays refused, and the one line a reshard prints ---------------------------------------------------------

def _fake_checkpoint(directory, argv: list[str], world_size: int) -> None:
    """A checkpoint's metadata only (synthetic: the layout check reads nothing else)."""
    (directory / "iter_0000003").mkdir(parents=True)
    layout = checkpoint_layout(parse_args(TINY + argv, world_size=world_size))
    (directory / "iter_0000003" / "layout.json").write_text(json.dumps(layout))
    (directory / LATEST_CHECKPOINT_FILE).write_text("3\n")


def test_parallel_layout_may_differ_but_model_precision_optimizer_and_global_batch_may_not(tmp_path):
    _fake_checkpoint(tmp_path, TP2 + PP2 + ["--micro-batch-size", "2", "--overlap-grad-reduce"], world_size=8)
    parse_args(TINY + ["--load", str(tmp_path)], world_size=1)
    for flags, key in ((["--hidden-size", "128"], "hidden_size"), (["--bf16"], "params_dtype"),
                       (DISTOPT, "use_distributed_optimizer"), (["--global-batch-size", "8"], "global_batch_size")):
        with pytest.raises(ConfigError, match=f"saved with {key} .* but loads only into the same model shape"):
            parse_args(TINY + flags + ["--load", str(tmp_path)], world_size=1)


def test_a_checkpoint_of_another_model_shape_is_refused_by_the_cli_in_one_line(tmp_path):
    """Saved at TP2 (which would reshard) and with another hidden size (which cannot): the refusal wins."""
    _fake_checkpoint(tmp_path, TP2, world_size=2)
    proc = subprocess.run([sys.executable, "-m", "cli.main", "train", *TINY, "--hidden-size", "128",
                           "--load", str(tmp_path)], capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert len(lines) == 1 and "iter_0000003 was saved with hidden_size 64, this run has 128" in lines[0], lines


def test_a_layout_that_loses_its_pipeline_split_is_refused_in_one_line(tmp_path):
    """Saved at PP3 with stages of 1, 2, 1 layers: layout.json records the split, so it reshards (the slow case
    above). Without it (a layout written before the split was recorded) 4 layers do not split over 3 stages, and the
    load is refused before any rank starts, rather than a rank failing on a layer its saved stage never held."""
    uneven = ["--pipeline-model-parallel-size", "3", "--num-layers", "4", "--decoder-first-pipeline-num-layers", "1",
              "--decoder-last-pipeline-num-layers", "1"]
    _fake_checkpoint(tmp_path, uneven, world_size=3)
    parse_args(TINY + ["--num-layers", "4", "--load", str(tmp_path)], world_size=1)
    path = tmp_path / "iter_0000003" / "layout.json"
    layout = json.loads(path.read_text())
    path.write_text(json.dumps({k: v for k, v in layout.items() if "pipeline_num_layers" not in k}))
    with pytest.raises(ConfigError, match="layout.json records a pipeline split its layers do not fit: --num-layers 4 "
                                          "is not divisible by pipeline size 3"):
        parse_args(TINY + ["--num-layers", "4", "--load", str(tmp_path)], world_size=1)


def test_the_note_names_both_layouts_and_the_ranks_whose_rng_starts_fresh(tmp_path):
    """DP1 -> DP2: rank 1 (dp 1) has no saved rank at its coordinates; DP2 -> DP1: rank 0 has one."""
    one = checkpoint_layout(parse_args(TINY, world_size=1))
    two = checkpoint_layout(parse_args(TINY, world_size=2))
    assert resharding_note(parse_args(TINY, world_size=2), one, "iter_0000003") == (
        "train-ledger: resharding iter_0000003 saved at tp 1 pp 1 dp 1 (micro-batch 1) to tp 1 pp 1 dp 2 "
        "(micro-batch 1); ranks [1] have no saved rank at their coordinates and start their RNG states fresh from "
        "--seed: the resume is not bit-exact")
    assert resharding_note(parse_args(TINY, world_size=1), two, "iter_0000003") == (
        "train-ledger: resharding iter_0000003 saved at tp 1 pp 1 dp 2 (micro-batch 1) to tp 1 pp 1 dp 1 "
        "(micro-batch 1)")


@pytest.mark.parametrize("stride", [1, 2])
def test_unpartition_inverts_the_engines_partition(stride):
    master = torch.arange(8 * 3).view(8, 3)
    for dim in (0, 1):
        full = master if dim == 0 else master.t().contiguous()
        shards = [partition(full, dim, stride, rank, 2) for rank in range(2)]
        assert torch.equal(unpartition(shards, dim, stride), full)


def test_a_layout_change_within_one_rank_resumes_bit_for_bit(tmp_path):
    """At DP1 the DDP buckets change nothing numerically, so a checkpoint saved with many buckets and loaded with
    one (a reshard: the distributed optimizer's pieces change) continues exactly as the straight run; under
    --no-load-optim it takes the params only."""
    flags = TINY + DISTOPT + ["--bf16", "--train-iters", "4"]
    buckets = ["--overlap-grad-reduce", "--ddp-bucket-size", "3000"]
    straight = _run(1, flags + buckets + ["--save", str(tmp_path), "--save-interval", "2"])
    (tmp_path / LATEST_CHECKPOINT_FILE).write_text("2\n")  # resume from iteration 2, not 4
    resumed = _run(1, flags + ["--load", str(tmp_path)])
    _assert_same_state(resumed["loaded"], straight["saved"])
    assert resumed["losses"] == straight["losses"][2:]
    params_only = _run(1, flags + ["--load", str(tmp_path), "--no-load-optim"])
    assert params_only["losses"][0] == straight["losses"][2]  # computed before the first update
    assert params_only["losses"][1] != straight["losses"][3]  # a fresh Adam
