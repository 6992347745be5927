"""Core attention: the engine's causal SDPA (EngineKernels.core_attention: on the run's --attention-backend kernel),
GQA, on [b, heads, s, d] views of [s, b, heads, d] tensors as the engine calls it; under context parallelism (C > 1)
ring attention's block kernels (EngineKernels.ring: the engine's own, flash on CUDA in 16 bits, the maths elsewhere)
at the ring's two shapes, the causal diagonal block (L x L) and an unmasked half block (L/2 queries of the rank's
second chunk against a whole L-key block), forward, and backward given that block's out and log-sum-exp; and
ring_attention.merge: the engine's ring loop on a ring of C without exchanges, its blocks answered by precomputed
results, so what is timed is the online-softmax merges (forward) and the dQ / dK-dV accumulations (backward). The
exchanges are the bandwidth sweep's."""
from __future__ import annotations

import math

import torch

from probes.compute_sweep.calls import Backward, Bench, Builder, Call, Op


def dense(b: Bench) -> dict[str, Builder]:
    t = b.tensors

    def leaves(d: dict[str, int], grad: bool) -> tuple[torch.Tensor, ...]:
        return tuple(t.randn(d["seq"], d["batch"], n, d["head_dim"], grad=grad)
                     for n in (d["heads"], d["kv_heads"], d["kv_heads"]))

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool) -> torch.Tensor:
        q, k, v = (x.permute(1, 2, 0, 3) for x in (q, k, v))
        return b.kernels.core_attention(q, k, v, gqa)

    def forward(d: dict[str, int]) -> Op:
        q, k, v = leaves(d, False)
        return Call(lambda: attend(q, k, v, d["heads"] > d["kv_heads"]))

    def backward(d: dict[str, int]) -> Op:
        q, k, v = leaves(d, True)
        # as linear_proj's input grad arrives, viewed back
        grad = t.randn(d["seq"], d["batch"], d["heads"], d["head_dim"]).permute(1, 2, 0, 3)
        return Backward(lambda: attend(q, k, v, d["heads"] > d["kv_heads"]), (q, k, v), (grad,))

    return {"core_attention.fwd": forward, "core_attention.bwd": backward}


def ring(b: Bench) -> dict[str, Builder]:
    """Ring attention on L = s/C local tokens as ring_forward / ring_backward run it: q a [b, heads, L, d] view of
    [L, b, heads, d] (its second half's rows for the half block), K and V of the stacked [2, b, kv_heads, L, d]
    block; the backward given the block's out in the compute dtype and its lse; the loops as CP rank 0 runs them."""
    t, kernels = b.tensors, b.kernels.ring

    def rows(d: dict[str, int], causal: bool) -> slice:
        return slice(None) if causal else slice(d["seq"] // 2, None)

    def operands(d: dict[str, int]) -> tuple[torch.Tensor, torch.Tensor]:
        q = t.randn(d["seq"], d["batch"], d["heads"], d["head_dim"]).permute(1, 2, 0, 3)
        return q, torch.stack([t.randn(d["seq"], d["batch"], d["kv_heads"], d["head_dim"]).permute(1, 2, 0, 3)
                               for _ in range(2)])

    def block(d: dict[str, int], backward: bool) -> Op:
        causal, scale = bool(d["causal"]), 1.0 / math.sqrt(d["head_dim"])
        q, kv_block = operands(d)
        q, k, v = q[:, :, rows(d, causal)], kv_block[0], kv_block[1]
        forward, backward_fn = kernels.blocks(q)
        if not backward:
            return Call(lambda: forward(q, k, v, causal, scale))
        out, lse = forward(q, k, v, causal, scale)
        out = out.to(t.dtype)
        dout = t.randn(d["batch"], d["heads"], d["seq"], d["head_dim"])[:, :, :q.shape[2]]
        return Call(lambda: backward_fn(dout, q, k, v, out, lse, causal, scale))

    def merges(d: dict[str, int], backward: bool) -> Op:
        scale = 1.0 / math.sqrt(d["head_dim"])
        q, kv_block = operands(d)
        forward, backward_fn = kernels.blocks(q)
        cp = kernels.group(d["cp"])
        if not backward:
            done = {c: forward(q[:, :, rows(d, c)], kv_block[0], kv_block[1], c, scale) for c in (True, False)}
            return Call(lambda: kernels.forward(q, kv_block, cp, scale, lambda *args: done[args[3]]))
        out, lse, _ = kernels.forward(q, kv_block, cp, scale, forward)
        out, dout = out.to(t.dtype), t.randn(d["batch"], d["heads"], d["seq"], d["head_dim"])
        done = {c: backward_fn(dout[:, :, rows(d, c)], q[:, :, rows(d, c)], kv_block[0], kv_block[1],
                               out[:, :, rows(d, c)], lse[:, :, rows(d, c)], c, scale) for c in (True, False)}
        return Call(lambda: kernels.backward(dout, q, kv_block, out, lse, cp, scale, lambda *args: done[args[6]]))

    return {"core_attention.fwd": lambda d: block(d, False), "core_attention.bwd": lambda d: block(d, True),
            "ring_attention.merge.fwd": lambda d: merges(d, False),
            "ring_attention.merge.bwd": lambda d: merges(d, True)}
