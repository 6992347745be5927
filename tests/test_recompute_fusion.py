"""Gradient-accumulation fusion under full activation recompute (engine/tensor_parallel/layers.py).

Full recompute runs a group's forward again inside torch's non-reentrant checkpoint, and what a re-run forward saves
comes back to the backward as detached aliases: the saved weight has none of its Parameter's DDP attributes
(main_grad, the fusion's flag). The linear's backward reads them from the Parameter itself (ctx.param), so every
weight-gradient GEMM adds into main_grad as it does without recompute; before, each checkpointed linear fell back to a
16-bit wgrad that DDP's hook added, silently (found on 2026-12-03 by --moe-delay-expert-wgrad holding nothing there).
Megatron's --no-gradient-accumulation-fusion turns the fusion off on purpose, and the run's config says so.
"""
from __future__ import annotations

import json

import engine.tensor_parallel.layers as layers
from cli.main import main as cli
from common.arguments import parse_args
from common.config import RunConfig
from common.ops.linear import MAIN_GRAD_ADD
from ledger.models.time_model.ops import chunk_backward, kernels
from tests.support.parity import train_alone

BASE = ["--model", "tiny", "--num-layers", "2", "--micro-batch-size", "1", "--global-batch-size", "2",
        "--train-iters", "1", "--mock-data"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]


def fused_wgrads(flags: list[str], monkeypatch) -> int:
    """Weight-gradient GEMMs that added into a main_grad in one training step."""
    calls = []
    real = layers.addmm_into
    monkeypatch.setattr(layers, "addmm_into", lambda c, a, b: (calls.append(c.shape), real(c, a, b))[1])
    train_alone(BASE + flags)
    monkeypatch.setattr(layers, "addmm_into", real)
    return len(calls)


def test_every_linear_fuses_its_weight_gradient_under_full_recompute_as_without(monkeypatch):
    plain = fused_wgrads([], monkeypatch)
    assert plain == 2 * (2 * 4 + 1)  # 2 micro-batches x (2 layers x qkv, proj, fc1, fc2 + the output layer)
    assert fused_wgrads(RECOMPUTE, monkeypatch) == plain


def test_no_gradient_accumulation_fusion_is_the_runs_config_the_engines_and_the_ledgers(monkeypatch):
    """The flag (once an environment variable the run's config never saw, so the ledger priced such a run fused):
    recorded, no weight-gradient GEMM adds into main_grad, and the ledger prices each linear's 16-bit wgrad and DDP's
    add after it."""
    off = parse_args(BASE + ["--no-gradient-accumulation-fusion"], world_size=1)
    assert not off.implementation.gradient_accumulation_fusion
    assert not RunConfig.from_dict(off.to_dict()).implementation.gradient_accumulation_fusion
    assert parse_args(BASE, world_size=1).implementation.gradient_accumulation_fusion
    assert fused_wgrads(["--no-gradient-accumulation-fusion"], monkeypatch) == 0
    fused, unfused = (chunk_backward(c, 0, 0) for c in (parse_args(BASE, world_size=1), off))
    adds = [w for w in unfused if w.op.name == MAIN_GRAD_ADD]
    assert not any(w.op.name == MAIN_GRAD_ADD for w in fused)
    # one a linear: the layers' 2 x 4 finalise their weights; the tied output layer's is final at the embedding's
    assert len(adds) == 2 * 4 + 1 and sum(w.param is not None for w in adds) == 2 * 4
    assert len(unfused) == len(fused) + len(adds)
    assert {w.op for w in adds} <= kernels(off, 0), "the catalogue (what the sweep times) lists every add"


def test_simulate_prices_the_unfused_wgrads_add_on_host_and_device(capsys):
    """llama3.2-1b at seq 4096 from the H200 file: each linear's 16-bit wgrad read back and added into the fp32
    main_grad (2 a + 4 g + 4 g bytes an element) makes the step longer, never shorter."""
    shape = ("simulate --world-size 1 --hardware H200 --model llama3.2-1b --seq-length 4096 --micro-batch-size 1 "
             "--global-batch-size 8 --bf16 --use-distributed-optimizer --json").split()

    def step_s(flags: list[str]) -> float:
        assert cli(shape + flags) == 0
        return json.loads(capsys.readouterr().out)["step"]["step_time_s"]

    assert step_s(["--no-gradient-accumulation-fusion"]) > 1.02 * step_s([])
