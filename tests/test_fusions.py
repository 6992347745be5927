"""The GPU fast paths, checked on CPU: jit_fuser's compiled functions against their eager selves, and gradient
accumulation fusion against the unfused DDP add.

The compiled tests force engine.jit to compile on CPU (inductor's C++ backend) for a tiny model, so they take tens
of seconds, most of it compiling.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.config import PRESETS, ModelConfig
from engine import jit
from engine.models.gpt_model import GPTModel
from engine.parallel_state import ParallelState
from engine.tensor_parallel import layers
from engine.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from engine.tensor_parallel.layers import ColumnParallelLinear
from engine.tensor_parallel.mappings import TPGroup
from engine.tensor_parallel.random import MasterWeightInit

TINY = ModelConfig(**PRESETS["tiny"])
S, B = 16, 2


def _loss_and_grads(model: GPTModel, seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = torch.randint(0, TINY.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(seed))
    loss = model(ids[:, :-1], ids[:, 1:])
    model.zero_grad(set_to_none=True)
    loss.mean().backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("dtype, rtol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_compiled_model_matches_eager(monkeypatch, dtype, rtol):
    """RoPE, SwiGLU and the three cross-entropy passes compiled (as on GPU) give the eager model's loss and grads."""
    state = ParallelState(rank=0, world_size=1, tp_size=1, pp_size=1, dp_size=1, cp_size=1, tp_rank=0, pp_rank=0,
                          dp_rank=0, cp_rank=0)
    model = GPTModel(TINY, state, pre_process=True, post_process=True, layer_numbers=list(range(TINY.num_layers)),
                     sequence_parallel=False, params_dtype=dtype, device="cpu")
    eager_loss, eager_grads = _loss_and_grads(model)
    jit.compiled.cache_clear()
    monkeypatch.setattr(jit, "COMPILE_DEVICE_TYPES", {"cpu"})
    loss, grads = _loss_and_grads(model)
    assert jit.compiled.cache_info().currsize == 5  # split_qkv_and_rotate, swiglu and the three CE passes
    torch.testing.assert_close(loss, eager_loss, rtol=rtol, atol=0)
    for name, grad in grads.items():
        scale = eager_grads[name].abs().max()
        torch.testing.assert_close(grad, eager_grads[name], rtol=rtol, atol=rtol * scale,
                                   msg=lambda m: f"{name}: {m}")


@pytest.mark.slow
def test_compiled_cross_entropy_masks_vocabulary_padding(monkeypatch):
    """Padded columns (here with logits that would dominate) take no probability mass on the compiled path."""
    vocab, padded = 10, 16
    logits = torch.randn(S, B, padded, generator=torch.Generator().manual_seed(1))
    logits[..., vocab:] = 50.0
    target = torch.randint(0, vocab, (S, B), generator=torch.Generator().manual_seed(2))
    oracle_logits = logits.clone().requires_grad_()
    oracle = F.cross_entropy(oracle_logits[..., :vocab].reshape(-1, vocab), target.reshape(-1), reduction="none")
    oracle.sum().backward()
    monkeypatch.setattr(jit, "COMPILE_DEVICE_TYPES", {"cpu"})
    local = logits.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, TPGroup(None, 1, 0), vocab)
    loss.sum().backward()
    torch.testing.assert_close(loss, oracle.detach().view(S, B))
    torch.testing.assert_close(local.grad, oracle_logits.grad)


def _linear_under_ddp(params_dtype: torch.dtype, fusion: bool = True) -> ColumnParallelLinear:
    """A linear whose weight is set up as DDP sets its parameters up: an fp32 main_grad, the fusion flag, and a
    post-accumulate-grad hook that adds .grad into main_grad unless the flag says the layer already did; `fusion` as
    the model builder sets it from --no-gradient-accumulation-fusion."""
    layer = ColumnParallelLinear(12, 16, tp=TPGroup(None, 1, 0), init=MasterWeightInit(0.5, 7, "w"),
                                 params_dtype=params_dtype, device="cpu")
    layers.set_gradient_accumulation_fusion(layer, fusion)
    weight = layer.weight
    weight.main_grad = torch.zeros(weight.shape, dtype=torch.float32)
    weight.grad_added_to_main_grad = False
    weight.hook_calls = 0

    def hook(param):
        if param.grad_added_to_main_grad:
            param.grad_added_to_main_grad = False
        else:
            param.main_grad.add_(param.grad)
        param.grad = None
        param.hook_calls += 1

    weight.register_post_accumulate_grad_hook(hook)
    return layer


@pytest.mark.parametrize("fusion", [True, False])
@pytest.mark.parametrize("params_dtype", [torch.float32, torch.bfloat16])
def test_gradient_accumulation_fusion_accumulates_like_ddp(fusion, params_dtype):
    """Two micro-batches: main_grad holds the sum of the weight gradients whether the GEMM added them (fusion; on
    CPU only for fp32 weights, there is no bf16 x bf16 -> fp32 addmm here) or DDP's hook did."""
    layer = _linear_under_ddp(params_dtype, fusion)
    expected = torch.zeros(16, 12)
    for seed in (1, 2):
        x = torch.randn(S, B, 12, generator=torch.Generator().manual_seed(seed)).to(params_dtype)
        g = torch.randn(S, B, 16, generator=torch.Generator().manual_seed(seed + 10)).to(params_dtype)
        (layer(x.requires_grad_()) * g).sum().backward()
        expected += (g.reshape(-1, 16).t().float() @ x.detach().reshape(-1, 12).float())
    weight = layer.weight
    assert weight.hook_calls == 2 and weight.grad is None and weight.grad_added_to_main_grad is False
    assert layers.fuses_weight_grad(weight) == (fusion and params_dtype == torch.float32)
    rtol = 1e-5 if params_dtype == torch.float32 else 2e-2
    torch.testing.assert_close(weight.main_grad, expected, rtol=rtol, atol=rtol * expected.abs().max())
