"""A layer's elementwise kernels: rms_norm (F.rms_norm; layer_norm: F.layer_norm with a weight and a bias, the GPT
style) forward / backward, residual_add, the attention output's [b, h, s, d] -> [s, b, h d] copy, and the engine's
own fused functions (EngineKernels: compiled on GPU as the engine compiles them): rope (split_qkv_and_rotate) and
swiglu forward / backward (an expert's at its rows through the MoE layer's own); the GPT style's gelu is Megatron's
bias_gelu as torch's tanh GeLU of the input plus a bias (the engine runs none); without gradient-accumulation fusion,
DDP's hook adding a 16-bit weight gradient into its main_grad (main_grad.add)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from common.ops.linear import MAIN_GRAD_ADD
from probes.compute_sweep.calls import Backward, Bench, Builder, Call, Op


def builders(b: Bench) -> dict[str, Builder]:
    t, sh, kernels = b.tensors, b.shapes, b.kernels
    s, batch = sh.seq, sh.micro_batch

    def norm(layer_norm: bool, backward: bool) -> Builder:
        def build(d: dict[str, int]) -> Op:
            rows, h = d["tokens"], d["hidden"]

            def normalize() -> torch.Tensor:
                return F.layer_norm(x, (h,), w, bias, 1e-5) if bias is not None else F.rms_norm(x, (h,), w, 1e-5)

            x, w = t.randn(rows, h, grad=backward), t.randn(h, grad=backward)
            if not backward:
                bias = t.randn(h) if layer_norm else None
                return Call(normalize)
            g = t.randn(rows, h)
            bias = t.randn(h, grad=True) if layer_norm else None
            return Backward(normalize, (x, w) if bias is None else (x, w, bias), (g,))
        return build

    def add(d: dict[str, int]) -> Op:
        x, y = t.randn(d["numel"]), t.randn(d["numel"])
        return Call(lambda: torch.add(x, y))

    def grad_add(d: dict[str, int]) -> Op:
        main_grad, grad = torch.zeros(d["numel"], device=t.device, dtype=b.grad_dtype), t.randn(d["numel"])
        return Call(lambda: main_grad.add_(grad))

    def copy(d: dict[str, int]) -> Op:
        x = t.randn(batch, sh.heads, s, sh.head_dim)
        return Call(lambda: x.permute(2, 0, 1, 3).reshape(s, batch, -1))

    def rotary(backward: bool) -> Builder:
        def build(d: dict[str, int]) -> Op:
            groups, width, head_dim = d["groups"], d["width"], d["head_dim"]
            qkv = t.randn(d["seq"], d["batch"], groups, width, head_dim, grad=backward)
            cos, sin = t.randn(d["seq"], 1, 1, head_dim), t.randn(d["seq"], 1, 1, head_dim)
            if not backward:
                return Call(lambda: kernels.split_qkv_and_rotate(qkv, cos, sin))
            grads = (t.randn(d["seq"], d["batch"], groups * (width - 2), head_dim),
                     t.randn(d["seq"], d["batch"], groups, head_dim), t.randn(d["seq"], d["batch"], groups, head_dim))
            return Backward(lambda: kernels.split_qkv_and_rotate(qkv, cos, sin), (qkv,), grads)
        return build

    def gated(backward: bool) -> Builder:
        """The dense MLP's SwiGLU on [s, b, 2f]; an expert's on its [rows, 2f] through the MoE layer's own."""
        def build(d: dict[str, int]) -> Op:
            rows = (s, batch) if sh.moe is None else (d["tokens"],)
            swiglu = kernels.swiglu if sh.moe is None else kernels.moe.swiglu
            y = t.randn(*rows, d["width"], grad=backward)
            if not backward:
                return Call(lambda: swiglu(y))
            return Backward(lambda: swiglu(y), (y,), (t.randn(*rows, d["width"] // 2),))
        return build

    def bias_gelu(backward: bool) -> Builder:
        def build(d: dict[str, int]) -> Op:
            x, bias = t.randn(s, batch, d["width"], grad=backward), t.randn(d["width"], grad=backward)
            if not backward:
                return Call(lambda: F.gelu(x + bias, approximate="tanh"))
            return Backward(lambda: F.gelu(x + bias, approximate="tanh"), (x, bias), (t.randn(s, batch, d["width"]),))
        return build

    out: dict[str, Builder] = {"residual_add": add, "attention_output.copy": copy, MAIN_GRAD_ADD: grad_add}
    for p, backward in (("fwd", False), ("bwd", True)):
        out |= {f"rms_norm.{p}": norm(False, backward), f"layer_norm.{p}": norm(True, backward),
                f"rope.{p}": rotary(backward), f"swiglu.{p}": gated(backward), f"gelu.{p}": bias_gelu(backward)}
    return out
