"""GEMMs: a linear's fprop (x W^T), dgrad (dY W) and wgrad (dY^T X accumulated into a grad-dtype main_grad by the
engine's own function, EngineKernels.wgrad: in one GEMM where the device can, else a GEMM and an add), at the
catalogue's m, n, k (common/ops/linear.py). An fp8 linear's (dims fp8=1) go through the engine's float8 matmul
(EngineKernels.fp8_linear): fprop its forward, dgrad and wgrad its backward for the input or the weight, wgrad
followed by DDP's add into main_grad."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from common.ops.linear import FP8
from probes.compute_sweep.calls import Backward, Bench, Builder, Call, Op


def builders(b: Bench) -> dict[str, Builder]:
    """By pass: every linear's GEMMs (a layer's, the router's, an expert's, the output layer's) are these three."""
    t = b.tensors

    def fprop(d: dict[str, int]) -> Op:
        x, w = t.randn(d["m"], d["k"]), t.randn(d["n"], d["k"])
        if d.get(FP8):
            fp8 = _fp8_linear(b)
            return Call(lambda: fp8(x, w))
        return Call(lambda: F.linear(x, w))

    def dgrad(d: dict[str, int]) -> Op:
        if d.get(FP8):  # rows m, input width n, output width k
            fp8, x, w = _fp8_linear(b), t.randn(d["m"], d["n"], grad=True), t.randn(d["k"], d["n"])
            return Backward(lambda: fp8(x, w), (x,), (t.randn(d["m"], d["k"]),))
        g, w = t.randn(d["m"], d["k"]), t.randn(d["k"], d["n"])
        return Call(lambda: g.matmul(w))

    def wgrad(d: dict[str, int]) -> Op:
        if d.get(FP8):  # output width m, input width n, rows k
            fp8, x, w = _fp8_linear(b), t.randn(d["k"], d["n"]), t.randn(d["m"], d["n"], grad=True)
            main_grad = torch.zeros(d["m"], d["n"], device=t.device, dtype=b.grad_dtype)
            return Backward(lambda: fp8(x, w), (w,), (t.randn(d["k"], d["m"]),),
                            after=lambda grads: main_grad.add_(grads[0]))
        g, x = t.randn(d["k"], d["m"]), t.randn(d["k"], d["n"])
        if not b.kernels.wgrad_fusion:  # the 16-bit GEMM; DDP's hook's add is the catalogue's main_grad.add
            return Call(lambda: g.t().matmul(x))
        main_grad = torch.zeros(d["m"], d["n"], device=t.device, dtype=b.grad_dtype)
        return Call(lambda: b.kernels.wgrad(main_grad, g, x))

    return {"fprop": fprop, "dgrad": dgrad, "wgrad": wgrad}


def _fp8_linear(b: Bench):
    if b.kernels.fp8_linear is None:
        raise ValueError("a sweep of fp8 linears needs the engine's float8 matmul (EngineKernels.fp8_linear)")
    return b.kernels.fp8_linear
