"""finalize_model_grads: everything between the last backward and optimizer.step() (docs/engine.md).

1. Finish the DP reduction of every model chunk (waits for the overlapped collectives, or runs them now).
2. Sum over TP the gradients of parameters replicated across TP under sequence parallelism (`sequence_parallel`
   attribute, RMSNorm weights): each TP rank saw only its slice of the sequence, so each holds a partial gradient.
Embeddings are untied and positions are rotary, so pipeline stages share no parameter and need nothing more.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors


def finalize_model_grads(model_chunks: list[torch.nn.Module], parallel_state: Any) -> None:
    for chunk in model_chunks:
        chunk.finish_grad_sync()
    _allreduce_sequence_parallel_grads(model_chunks, parallel_state)


def _allreduce_sequence_parallel_grads(model_chunks: list[torch.nn.Module], parallel_state: Any) -> None:
    if parallel_state.tp_size == 1:
        return
    grads = [p.main_grad for chunk in model_chunks for p in chunk.parameters()
             if p.requires_grad and getattr(p, "sequence_parallel", False)]
    if not grads:
        return
    # One collective for all of them: these are many tiny vectors.
    coalesced = _flatten_dense_tensors(grads)
    dist.all_reduce(coalesced, group=parallel_state.groups["tp"])
    for grad, reduced in zip(grads, _unflatten_dense_tensors(coalesced, grads)):
        grad.copy_(reduced)
