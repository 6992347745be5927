"""Per-layer CUDA graphs (Megatron-LM's --cuda-graph-impl local): each transformer layer's forward and its backward
captured once as two CUDA graphs and replayed every micro-batch, so that the host issues one launch per layer and
pass instead of one per kernel. Where the host paces the step (small layers: docs/formulas.md, "Host timeline") the
device then runs the layer's kernels back to back.

torch.cuda.make_graphed_callables does the capture: a few warm-up passes on a side stream (the compiled fusions
compile there, cuBLAS picks its kernels), then every layer's forward in order and every backward in reverse, all in
one memory pool. A graphed layer reads its input from a static buffer (the caller's tensor is copied in unless it is
that buffer: RoPE's cos / sin are the model's cached ones, so they are not) and returns static outputs; the pool keeps
one micro-batch's saved activations of every layer for the run's lifetime, which is why one micro-batch in flight is
the rule (common/config/run_config.check_cuda_graphs).

Gradient-accumulation fusion inside a graph: a linear's weight-gradient GEMM adds into DDP's main_grad in the
captured backward, so every replay adds again, at the same addresses (the grad buffers never move). The linear sets
DDP's `grad_added_to_main_grad` flag in Python, which a replay does not run: a forward pre-hook on each graphed
layer sets it for those weights, once per micro-batch, before the backward whose DDP hook clears it. The warm-up
passes also add into main_grad; the step's zero_grad_buffer clears that before the first micro-batch.
"""
from __future__ import annotations

from typing import Any

import torch

from common.config import RunConfig
from common.errors import ConfigError
from probes.graph_capture import capture_stream_mismatch_quiet
from probes.probe_set import NullProbeSet
from probes.protocol import ProbeSetProtocol

WARMUP_PASSES = 3  # make_graphed_callables' default: lazy initialisation and compilation stay out of the capture


def fused_weights(layer: torch.nn.Module) -> list[torch.nn.Parameter]:
    """The layer's weights whose gradient the captured backward added into main_grad (their flag is up after the
    capture)."""
    return [p for p in layer.parameters() if getattr(p, "grad_added_to_main_grad", False)]


def _sample_args(model: torch.nn.Module, run_config: RunConfig, device: torch.device,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A layer's arguments: the hidden states [s, b, h] (requiring grad, as the embedding's output does) and the
    model's own cached cos / sin."""
    m, b = run_config.model, run_config.train.micro_batch_size
    hidden = torch.zeros(m.seq_length, b, m.hidden_size, device=device, dtype=dtype, requires_grad=True)
    cos, sin = model.rotary_pos_emb(m.seq_length, device, dtype)
    return hidden, cos, sin


def capture_layer_graphs(model: list[Any], run_config: RunConfig, device: torch.device,
                         probes: ProbeSetProtocol = NullProbeSet()) -> int:
    """Replace every transformer layer's forward and backward of this rank's model by CUDA graph replays; returns
    the number of layers graphed. model: the DDP-wrapped chunks (one: check_cuda_graphs allows no pipeline). The
    memory points before and after the capture measure what the graphs keep (the ledger's memory.cuda_graphs)."""
    if device.type != "cuda":
        raise ConfigError(f"--cuda-graph-impl local needs a CUDA device, not {device.type}")
    probes.memory_point("before_cuda_graphs")
    (chunk,) = model
    gpt = chunk.module
    layers = tuple(gpt.decoder.layers)
    dtype = next(gpt.parameters()).dtype
    samples = tuple(_sample_args(gpt, run_config, device, dtype) for _ in layers)
    with capture_stream_mismatch_quiet():
        torch.cuda.make_graphed_callables(layers, samples, num_warmup_iters=WARMUP_PASSES)
    for layer in layers:
        weights = fused_weights(layer)
        for weight in weights:
            weight.grad_added_to_main_grad = False
        layer.register_forward_pre_hook(_promise_fused_grads(weights))
    probes.memory_point("after_cuda_graphs")
    return len(layers)


def _promise_fused_grads(weights: list[torch.nn.Parameter]):
    """A forward pre-hook: the coming backward's replay adds these weights' gradients into main_grad itself."""
    def hook(module: torch.nn.Module, args: Any) -> None:
        for weight in weights:
            weight.grad_added_to_main_grad = True
    return hook
