"""The engine's own functions, handed to the sweep so that it times what a step runs (engine/probe_adapters.py
builds them from the model): the fused functions, the weight-gradient accumulation, the MoE layer's pieces and ring
attention's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class MoEKernels:
    """The engine's MoE layer pieces, as one rank runs them apart from the all-to-alls (its dispatcher at EP 1)."""
    route: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # logits [T, E] -> (experts, probs) [T, k]
    # (tokens [T, h], experts [T, k], probs [T, k] fp32, kept [T, k] bool) -> (rows by expert, rows per expert, plan)
    permute: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, list[int], Any]]
    unpermute: Callable[[torch.Tensor, Any], torch.Tensor]  # (expert rows, plan) -> [T, h]
    swiglu: Callable[[torch.Tensor], torch.Tensor]  # the experts' (compiled for any row count)
    # --moe-grouped-gemm: (rows [N, k] grouped by expert, the experts' weights [n, k] each, counts [E] on the device)
    # -> [N, n], as the engine's GroupedMLP multiplies them; None for SequentialMLP
    grouped_linear: Callable[[torch.Tensor, list[torch.Tensor], torch.Tensor], torch.Tensor] | None = None


@dataclass(frozen=True)
class RingKernels:
    """The engine's ring attention (engine/transformer/ring_attention.py) as the sweep times it, apart from its
    exchanges."""
    blocks: Callable[[torch.Tensor], tuple[Callable, Callable]]  # q -> (block forward, block backward) it runs
    forward: Callable[..., tuple[torch.Tensor, ...]]  # ring_forward(q, kv, cp, scale, attend)
    backward: Callable[..., tuple[torch.Tensor, ...]]  # ring_backward(dout, q, kv, out, lse, cp, scale, attend_bwd)
    group: Callable[[int], Any]  # C -> a ring of C (rank 0) with no process group: the loops then exchange nothing


@dataclass(frozen=True)
class EngineKernels:
    """The engine's own functions for the work it fuses, so the sweep times what runs; `variant` says how they run
    (compiled or eager) and keys the cache; `moe` for a model with experts, `ring` under context parallelism,
    `fp8_linear` under --fp8-format."""
    split_qkv_and_rotate: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    swiglu: Callable[[torch.Tensor], torch.Tensor]
    cross_entropy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits [s, b, v], target [s, b])
    # (q, k, v [b, heads, s, d], gqa) -> causal attention on the run's --attention-backend kernel
    core_attention: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, bool], torch.Tensor]
    # (main_grad [out, inp], grad_output [rows, out], input [rows, inp]): main_grad += grad_output^T input, as a
    # linear's backward leaves a weight's gradient (tensor_parallel.layers.accumulate_weight_grad)
    wgrad: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
    # (main_grad [V, h], ids [s, b], grad_output [s, b, h]): main_grad[ids] += the rows, as the embedding's lookup
    # leaves its gradient (tensor_parallel.layers.accumulate_embedding_grad)
    embedding_grad: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
    # (grads, max_norm, total_norm, optimizer): the clip as the engine's optimizer step applies it (in the fused
    # update's grad_scale, or in place: optimizer.clip_grads.clip_grad_by_total_norm_fp32)
    clip: Callable[[list[torch.Tensor], float, torch.Tensor, torch.optim.Optimizer], None]
    variant: str
    wgrad_fusion: bool = True  # `wgrad` adds into main_grad in the GEMM (off: the 16-bit GEMM alone is timed)
    moe: MoEKernels | None = None
    ring: RingKernels | None = None
    # --fp8-format: (x [rows, inp], weight [out, inp]) -> x W^T through the engine's float8 matmul, with its autograd
    fp8_linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None
