"""The per-element work (common/ops RATE_OPS), at up to RATE_NUMEL_CAP elements (the time model scales the
seconds to the run's counts): optimizer.step, one update as the engine's optimizer runs it (the grad copied into
the fp32 main grad when the grads are 16-bit, the grad norm, the engine's clip, fused AdamW on CUDA with the clip in
its update, foreach elsewhere after an in-place clip, the fp32 -> param copy), and grad_buffer.zero, a grad buffer's
memset; under Megatron-LM's local implementation optimizer.step_foreach, its fallback: torch's foreach AdamW, with
Megatron's local clip (a norm per tensor, then `dst.copy_(src * scale)`) and the copy to the 16-bit param."""
from __future__ import annotations

import torch

from common.ops.megatron import OPTIMIZER_STEP_FOREACH
from common.ops.rank import GRAD_BUFFER_ZERO, OPTIMIZER_STEP
from probes.compute_sweep.calls import Bench, Builder, Call, Op

RATE_NUMEL_CAP = 1 << 26


def builders(b: Bench) -> dict[str, Builder]:
    t, dtype, grad_dtype, clip = b.tensors, b.tensors.dtype, b.grad_dtype, b.kernels.clip

    def step(d: dict[str, int]) -> Op:
        main = t.randn(d["numel"], dtype=torch.float32)
        model = main if dtype == torch.float32 else main.to(dtype)
        grads = t.randn(d["numel"], dtype=grad_dtype)
        main.grad = grads if grad_dtype == torch.float32 else torch.empty_like(main)
        fused = {"fused": True} if t.device.type == "cuda" else {"foreach": True}
        optimizer = torch.optim.AdamW([main], lr=1e-4, weight_decay=0.01, **fused)

        @torch.no_grad()
        def update() -> None:
            if main.grad is not grads:
                main.grad.copy_(grads)
            norm = torch.stack(torch._foreach_norm([main.grad])).square().sum().sqrt()
            clip([main.grad], 1.0, norm, optimizer)
            optimizer.step()
            if model is not main:
                model.copy_(main)
        return Call(update)

    def foreach_step(d: dict[str, int]) -> Op:
        main = t.randn(d["numel"], dtype=torch.float32)
        model = main.to(dtype)
        main.grad = t.randn(d["numel"], dtype=torch.float32)
        optimizer = torch.optim.AdamW([main], lr=1e-4, weight_decay=0.01, foreach=True)

        @torch.no_grad()
        def update() -> None:
            norm = torch.norm(main.grad)
            main.grad.copy_(main.grad * (1.0 / (norm + 1e-6)).clamp(max=1.0))
            optimizer.step()
            model.copy_(main)
        return Call(update)

    def zero(d: dict[str, int]) -> Op:
        return Call(torch.empty(d["numel"], device=t.device, dtype=grad_dtype).zero_)

    return {OPTIMIZER_STEP: step, GRAD_BUFFER_ZERO: zero, OPTIMIZER_STEP_FOREACH: foreach_step}
