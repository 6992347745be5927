"""Gradient clipping by total norm inside torch's fused AdamW update (engine/optimizer/clip_grads.py).

Megatron scales every gradient by min(1, max_norm / (norm + 1e-6)) before the update: a pass that reads and writes
each fp32 gradient. torch's fused Adam(W) divides each gradient by its `grad_scale` as it updates (what AMP's
unscaling uses, writing the divided gradient back in the same pass), so the engine hands it the inverse and skips its
own pass. The update must be the clipped update to fp32 rounding, the gradients left clipped as Megatron leaves
them, and an optimizer without the fused kernel still clipped in place.
torch's fused AdamW runs on the CPU too, so this is checked here; the engine picks it on CUDA.
"""
from __future__ import annotations

import pytest
import torch

from engine.optimizer.clip_grads import clip_grad_by_total_norm_fp32

MAX_NORM = 1.0


def _steps(grads: list[torch.Tensor], fused: bool, clip_in_update: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Three AdamW steps on one parameter with these gradients, clipped to MAX_NORM; (the parameter, the gradients
    as the optimizer left them)."""
    param = torch.nn.Parameter(torch.linspace(-1.0, 1.0, grads[0].numel()))
    optimizer = torch.optim.AdamW([param], lr=1e-2, weight_decay=0.01, **({"fused": True} if fused else
                                                                          {"foreach": True}))
    seen = []
    for grad in grads:
        param.grad = grad.clone()
        norm = torch.linalg.vector_norm(param.grad)
        clip_grad_by_total_norm_fp32([param.grad], MAX_NORM, norm, optimizer if clip_in_update else None)
        optimizer.step()
        seen.append(param.grad.clone())
    return param.detach(), seen


def test_the_fused_update_with_the_clip_in_its_grad_scale_is_the_clipped_update():
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(4096, generator=gen) * scale for scale in (5.0, 0.001, 3.0)]  # clipped, not, clipped
    clipped, clipped_grads = _steps(grads, fused=True, clip_in_update=False)
    folded, folded_grads = _steps(grads, fused=True, clip_in_update=True)
    torch.testing.assert_close(folded, clipped, rtol=1e-6, atol=1e-7)
    for in_place, in_update in zip(clipped_grads, folded_grads):  # the update wrote the clipped gradients back
        torch.testing.assert_close(in_update, in_place, rtol=1e-6, atol=1e-9)


def test_under_the_clip_the_scale_is_one_and_without_the_fused_kernel_the_grads_are_clipped_in_place():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))], fused=True)
    clip_grad_by_total_norm_fp32([], MAX_NORM, torch.tensor(0.5), optimizer)
    assert optimizer.grad_scale.item() == 1.0 and optimizer.grad_scale.dtype == torch.float32
    clip_grad_by_total_norm_fp32([], MAX_NORM, torch.tensor(4.0), optimizer)
    assert optimizer.grad_scale.item() == pytest.approx(4.0)
    grad = torch.full((4,), 2.0)  # norm 4
    foreach = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))], foreach=True)
    clip_grad_by_total_norm_fp32([grad], MAX_NORM, torch.linalg.vector_norm(grad), foreach)
    assert not hasattr(foreach, "grad_scale")
    torch.testing.assert_close(grad, torch.full((4,), 0.5), rtol=1e-5, atol=0.0)
