"""GEMMs: a linear's fprop (x W^T), dgrad (dY W) and wgrad (dY^T X accumulated into a grad-dtype main_grad by the
engine's own function, EngineKernels.wgrad: in one GEMM where the device can, else a GEMM and an add), at the
catalogue's m, n, k (common/ops/linear.py)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from probes.compute_sweep.calls import Bench, Builder, Call, Op


def builders(b: Bench) -> dict[str, Builder]:
    """By pass: every linear's GEMMs (a layer's, the router's, an expert's, the output layer's) are these three."""
    t = b.tensors

    def fprop(d: dict[str, int]) -> Op:
        x, w = t.randn(d["m"], d["k"]), t.randn(d["n"], d["k"])
        return Call(lambda: F.linear(x, w))

    def dgrad(d: dict[str, int]) -> Op:
        g, w = t.randn(d["m"], d["k"]), t.randn(d["k"], d["n"])
        return Call(lambda: g.matmul(w))

    def wgrad(d: dict[str, int]) -> Op:
        g, x = t.randn(d["k"], d["m"]), t.randn(d["k"], d["n"])
        main_grad = torch.zeros(d["m"], d["n"], device=t.device, dtype=b.grad_dtype)
        return Call(lambda: b.kernels.wgrad(main_grad, g, x))

    return {"fprop": fprop, "dgrad": dgrad, "wgrad": wgrad}
