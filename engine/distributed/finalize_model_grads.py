"""finalize_model_grads: everything between the last backward and optimizer.step() (docs/engine.md).

0. Under --moe-delay-expert-wgrad, the experts' weight gradients held since each backward, added into main_grad
   (tensor_parallel/layers.py flush_delayed_weight_grads) before anything reads or reduces them: a probe range of
   category `wgrad`, which the ledger's time.delayed_wgrad_per_step row judges.
1. Finish the DP reduction of every model chunk (waits for the overlapped collectives, or runs them now): its dense
   buckets over dp x cp and, in an MoE model, its expert buckets over the expert-data-parallel group (DDP's
   bucket_groups hold both).
2. Sum over TP the gradients of parameters replicated across TP under sequence parallelism (`sequence_parallel`
   attribute, RMSNorm weights): each TP rank saw only its slice of the sequence, so each holds a partial gradient.
3. Tied embeddings under PP > 1: sum the gradients of the two copies of the word embeddings (first stage's embedding,
   last stage's output layer) over the embedding group, so both stages apply the same update and the copies stay
   equal. After the DP reduction, on the whole main_grad, as Megatron: under the distributed optimizer the shared
   weight has a bucket of its own laid out alike on both stages, so the elements this DP rank owns are reduced ones
   on both sides and their sum is right (the rest of main_grad is not read by this rank's optimizer).
Positions are rotary: there are no position embeddings to share.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from engine.tensor_parallel.layers import flush_delayed_weight_grads, holds_weight_grads
from probes.probe_set import NullProbeSet
from probes.protocol import ProbeSetProtocol


def finalize_model_grads(model_chunks: list[torch.nn.Module], parallel_state: Any,
                         probes: ProbeSetProtocol = NullProbeSet()) -> None:
    if any(holds_weight_grads(chunk) for chunk in model_chunks):
        with probes.range("delayed expert wgrad", "wgrad"):
            for chunk in model_chunks:
                flush_delayed_weight_grads(chunk)
    for chunk in model_chunks:
        chunk.finish_grad_sync()
    _allreduce_sequence_parallel_grads(model_chunks, parallel_state, probes)
    _allreduce_word_embedding_grads(model_chunks, parallel_state, probes)


def _allreduce_sequence_parallel_grads(model_chunks: list[torch.nn.Module], parallel_state: Any,
                                       probes: ProbeSetProtocol) -> None:
    if parallel_state.tp_size == 1:
        return
    grads = [p.main_grad for chunk in model_chunks for p in chunk.parameters()
             if p.requires_grad and getattr(p, "sequence_parallel", False)]
    if not grads:
        return
    # One collective for all of them: these are many tiny vectors.
    coalesced = _flatten_dense_tensors(grads)
    with probes.range("all-reduce sp norm grads", "tp-comm", bytes=coalesced.numel() * coalesced.element_size()):
        dist.all_reduce(coalesced, group=parallel_state.groups["tp"])
    for grad, reduced in zip(grads, _unflatten_dense_tensors(coalesced, grads)):
        grad.copy_(reduced)


def _allreduce_word_embedding_grads(model_chunks: list[torch.nn.Module], parallel_state: Any,
                                    probes: ProbeSetProtocol) -> None:
    """The embedding group is this rank's only on the first and last stage, and has two ranks only under PP > 1."""
    if "embedding" not in parallel_state.groups or parallel_state.pp_size == 1:
        return
    module = (model_chunks[0] if parallel_state.is_pipeline_first_stage else model_chunks[-1]).module
    if not module.share_embeddings_and_output_weights:
        return
    grad = module.shared_embedding_or_output_weight().main_grad
    with probes.range("all-reduce word embedding grads", "embd-comm", bytes=grad.numel() * grad.element_size()):
        dist.all_reduce(grad, group=parallel_state.groups["embedding"])
