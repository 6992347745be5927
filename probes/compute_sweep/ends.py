"""The end stages' kernels: on the first, embedding forward (a lookup) and backward (with `into_main_grad`, the
engine's lookup adding its rows into a main_grad; without, the dense embedding gradient added into one, as DDP's
hook does); on the last, the engine's vocab-parallel cross_entropy forward / backward (on a TP group of one: no
collective). The output layer's GEMMs are gemm.py's."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from common.ops.rank import INTO_MAIN_GRAD
from probes.compute_sweep.calls import Backward, Bench, Builder, Call, Op


def builders(b: Bench) -> dict[str, Builder]:
    t, s, batch = b.tensors, b.shapes.seq, b.shapes.micro_batch

    def lookup(d: dict[str, int]) -> Op:
        ids, w = t.ids(d["vocab"], s, batch), t.randn(d["vocab"], d["hidden"])
        return Call(lambda: F.embedding(ids, w))

    def lookup_backward(d: dict[str, int]) -> Op:
        ids, g = t.ids(d["vocab"], s, batch), t.randn(s, batch, d["hidden"])
        main_grad = torch.zeros(d["vocab"], d["hidden"], device=t.device, dtype=b.grad_dtype)
        if d.get(INTO_MAIN_GRAD):
            return Call(lambda: b.kernels.embedding_grad(main_grad, ids, g))
        w = t.randn(d["vocab"], d["hidden"], grad=True)
        return Backward(lambda: F.embedding(ids, w), (w,), (g,), lambda grads: main_grad.add_(grads[0]))

    def loss(backward: bool) -> Builder:
        def build(d: dict[str, int]) -> Op:
            logits, target = t.randn(s, batch, d["vocab"], grad=backward), t.ids(d["vocab"], s, batch)
            if not backward:
                return Call(lambda: b.kernels.cross_entropy(logits, target))
            g = t.randn(s, batch, dtype=torch.float32)
            return Backward(lambda: b.kernels.cross_entropy(logits, target), (logits,), (g,))
        return build

    return {"embedding.fwd": lookup, "embedding.bwd": lookup_backward, "cross_entropy.fwd": loss(False),
            "cross_entropy.bwd": loss(True)}
