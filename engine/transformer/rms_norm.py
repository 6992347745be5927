"""RMSNorm (Llama's norm): y = x / sqrt(mean(x^2) + eps) * weight, no bias, no mean subtraction.

The weight is replicated across TP. Under sequence parallelism each TP rank normalises a different slice of the
sequence, so its weight gradient is a partial sum: the weight carries `sequence_parallel=True` and
finalize_model_grads all-reduces such gradients over the TP group (Megatron's
_allreduce_layernorm_grads / sequence-parallel grads). It is not a TP shard: `tensor_model_parallel=False`.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.tensor_parallel.layers import set_tensor_model_parallel_attributes


class RMSNorm(torch.nn.Module):
    def __init__(self, hidden_size: int, eps: float, *, sequence_parallel: bool, params_dtype: torch.dtype,
                 device: torch.device | str):
        super().__init__()
        self.hidden_size, self.eps = hidden_size, eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=device))
        set_tensor_model_parallel_attributes(self.weight, False, None, 1)
        self.weight.sequence_parallel = sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (self.hidden_size,), self.weight, self.eps)
