"""This rank's experts (Megatron's SequentialMLP): E / EP SwiGLU MLPs of width moe_ffn_hidden_size, run one after
another on the tokens grouped by expert.

EP rank r holds global experts [r E/ep, (r + 1) E/ep). Each expert is a child module named by its global index, so
its parameters are `decoder.layers.{n}.mlp.experts.{e}.linear_fc1.weight` (and linear_fc2) at any EP size: that
name seeds its initial value (MasterWeightInit), so every EP split starts from the single-process model, and
checkpoints and parity tests match experts by it. Every expert parameter carries `allreduce = False` (Megatron's
marker): its gradient is reduced over the expert-data-parallel group, not the dense DP group.
"""
from __future__ import annotations

import dataclasses

import torch

from common.config import ModelConfig
from engine.tensor_parallel.mappings import TPGroup
from engine.transformer.mlp import MLP


def local_expert_indices(num_experts: int, ep_size: int, ep_rank: int) -> range:
    per_rank = num_experts // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


class SequentialMLP(torch.nn.Module):
    def __init__(self, config: ModelConfig, prefix: str, *, ep_size: int, ep_rank: int, tp: TPGroup,
                 params_dtype: torch.dtype, device: torch.device | str, seed: int):
        """prefix is the MoE layer's (`decoder.layers.{n}.mlp`)."""
        super().__init__()
        self.global_indices = local_expert_indices(config.num_experts, ep_size, ep_rank)
        expert_config = dataclasses.replace(config, ffn_hidden_size=config.expert_ffn_hidden_size)
        for e in self.global_indices:
            self.add_module(str(e), MLP(expert_config, f"{prefix}.experts.{e}", tp=tp, sequence_parallel=False,
                                        params_dtype=params_dtype, device=device, seed=seed, any_rows=True))
        for param in self.parameters():
            param.allreduce = False

    def forward(self, tokens: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """tokens [N, h] grouped by local expert, tokens_per_expert[i] rows for the i-th -> outputs [N, h]."""
        chunks = tokens.split(tokens_per_expert)
        return torch.cat([expert(chunk) for expert, chunk in zip(self.children(), chunks)])
