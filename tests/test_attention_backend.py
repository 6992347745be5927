"""--attention-backend (Megatron-LM's flag): `flash` leaves torch to pick among its SDPA kernels, `fused` pins cuDNN's
fused attention (engine/transformer/attention.py). On the H200 with torch 2.11 torch's pick already is cuDNN's kernel
(BENCHMARKS.md, "core attention's kernel"), so what the flag buys is a pinned kernel; these tests hold the plumbing:
every layer gets the backend, the compute sweep times core attention through the engine's own call with it, the
catalogue keys the fused kernel's timings apart so a cached flash timing never prices a fused run, and what cannot
run it is refused in one line.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from common.arguments import parse_args
from common.config.implementation_config import FLASH, FUSED
from common.errors import ConfigError
from common.ops.layer import layer_ops
from common.ops.shapes import Shapes
from engine.transformer.attention import SelfAttention, scaled_dot_product
from tests.support.cli import train_refusal
from tests.support.parity import built_alone


def _chunk(flags: list[str]):
    return built_alone(["--model", "tiny", *flags])


@pytest.mark.parametrize("flags, backend", [([], FLASH), (["--attention-backend", "fused"], FUSED)])
def test_every_layer_runs_core_attention_on_the_backend_given(flags, backend):
    layers = [m for m in _chunk(flags).modules() if isinstance(m, SelfAttention)]
    assert len(layers) == 4 and {m.attention_backend for m in layers} == {backend}


def test_the_catalogue_keys_the_fused_kernels_timings_apart():
    flash, fused = (layer_ops(Shapes.of(parse_args(["--model", "tiny", *extra], world_size=1))).attention.core
                    for extra in ([], ["--attention-backend", "fused"]))
    assert dict(fused.fwd.dims) == {**dict(flash.fwd.dims), "fused": 1}
    assert fused.fwd.flops == flash.fwd.flops and fused.bwd.flops == flash.bwd.flops


def test_the_compute_sweep_times_core_attention_through_the_engines_call_with_the_runs_backend():
    from engine.probe_adapters import engine_kernels
    from probes.compute_sweep import attention
    from probes.compute_sweep.calls import Bench, Tensors

    kernels = engine_kernels([_chunk(["--attention-backend", "fused"])], 1000, torch.device("cpu"))
    assert kernels.core_attention.keywords == {"backend": FUSED}
    calls = []

    def spy(q, k, v, gqa):
        calls.append(gqa)
        return scaled_dot_product(q, k, v, gqa, FLASH)

    bench = Bench(None, Tensors(torch.device("cpu"), torch.float32),
                  dataclasses.replace(kernels, core_attention=spy), torch.float32)
    dims = dict(seq=16, batch=1, heads=8, kv_heads=4, head_dim=8)
    for name, builder in attention.dense(bench).items():
        op = builder(dims)
        op.setup()
        op.run()
    assert calls == [True, True]  # the forward and the backward's forward, GQA: 8 heads over 4 groups


def test_fused_attention_is_refused_under_context_parallelism():
    with pytest.raises(ConfigError, match="--attention-backend fused: ring attention"):
        parse_args(["--model", "tiny", "--attention-backend", "fused", "--context-parallel-size", "2"], world_size=2)
    with pytest.raises(ConfigError, match="invalid choice: 'unfused'"):
        parse_args(["--model", "tiny", "--attention-backend", "unfused"])


def test_train_refuses_fused_attention_on_a_machine_without_a_gpu_before_any_rank_starts(tmp_path):
    assert train_refusal(tmp_path, ["--attention-backend", "fused"]) == [
        "train-ledger train: error: --attention-backend fused needs CUDA GPUs; this machine has none (NVML finds no "
        "device)"]
