"""SwiGLU MLP: down(silu(gate(x)) * up(x)), with gate and up fused into one ColumnParallelLinear (one GEMM).

The fused master weight is [gate; up] ([2f, h]); partition_stride 2 gives TP rank r the rows [gate_r; up_r], so
the local output splits in half into this rank's gate and up columns, which line up with the input columns of
the RowParallelLinear down projection it holds.

silu(gate) * up is a jit_fuser function: compiled on GPU it is one kernel each way (eager: two forward, four
backward), and autograd keeps only the fc1 output for backward (eager also keeps silu(gate), f values per token).
Gate and up are read as the two rows of a [.., 2, f] view of that output, so the backward's gradient is their stack:
inductor writes both halves from one loop (3.1 TB/s on an H200, where the halves as a chunk and a cat ran at 2.5:
BENCHMARKS.md, runs/bench/swiglu_kernels.py); the memory layout is the same [gate | up].
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from common.config import ModelConfig
from engine.jit import jit_fuser
from engine.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from engine.tensor_parallel.mappings import TPGroup
from engine.tensor_parallel.random import MasterWeightInit, scaled_init_std


def _swiglu(gate_and_up: torch.Tensor) -> torch.Tensor:
    halves = gate_and_up.view(*gate_and_up.shape[:-1], 2, gate_and_up.shape[-1] // 2)
    return F.silu(halves[..., 0, :]) * halves[..., 1, :]


swiglu = jit_fuser(_swiglu)
swiglu_any_rows = jit_fuser(_swiglu, dynamic_rows=True)  # an MoE expert's: its row count changes every micro-batch


class MLP(torch.nn.Module):
    def __init__(self, config: ModelConfig, prefix: str, *, tp: TPGroup, sequence_parallel: bool,
                 params_dtype: torch.dtype, device: torch.device | str, seed: int, any_rows: bool = False):
        """any_rows: the input's row count varies from call to call (an MoE expert's tokens)."""
        super().__init__()
        self.activation = swiglu_any_rows if any_rows else swiglu
        h, f, std = config.hidden_size, config.ffn_hidden_size, config.init_method_std
        self.linear_fc1 = ColumnParallelLinear(
            h, 2 * f, tp=tp, init=MasterWeightInit(std, seed, f"{prefix}.linear_fc1.weight"),
            params_dtype=params_dtype, device=device, sequence_parallel=sequence_parallel, stride=2)
        self.linear_fc2 = RowParallelLinear(
            f, h, tp=tp, init=MasterWeightInit(scaled_init_std(std, config.num_layers), seed,
                                               f"{prefix}.linear_fc2.weight"),
            params_dtype=params_dtype, device=device, input_is_parallel=True, sequence_parallel=sequence_parallel)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.activation(self.linear_fc1(hidden_states)))
