"""Gradient-accumulation fusion under full activation recompute (engine/tensor_parallel/layers.py).

Full recompute runs a group's forward again inside torch's non-reentrant checkpoint, and what a re-run forward saves
comes back to the backward as detached aliases: the saved weight has none of its Parameter's DDP attributes
(main_grad, the fusion's flag). The linear's backward reads them from the Parameter itself (ctx.param), so every
weight-gradient GEMM adds into main_grad as it does without recompute; before, each checkpointed linear fell back to a
16-bit wgrad that DDP's hook added, silently (found on 2026-12-03 by --moe-delay-expert-wgrad holding nothing there).
"""
from __future__ import annotations

import engine.tensor_parallel.layers as layers
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
