"""Causal self-attention with grouped-query attention (GQA), as Megatron's SelfAttention: no biases.

Fused QKV layout (Megatron's): the master linear_qkv weight [(n_q + 2 n_kv) d, h] is ordered by query group,

    [ q heads of group 0 (n_q/n_kv heads x d) | k_0 (d) | v_0 (d) | q heads of group 1 | k_1 | v_1 | ... ]

so the plain contiguous TP split of its rows (stride 1) gives each TP rank whole query groups: rank r holds groups
[r n_kv/tp, (r+1) n_kv/tp) with their own K and V, and attention needs no communication. Query head j of local
group g is local head g (n_q/n_kv) + j, which is the head order SDPA's enable_gqa expects (query head i reads KV
head i // (n_q/n_kv)).

Attention runs through F.scaled_dot_product_attention with is_causal=True (flash attention on GPU), so no s x s
score matrix is stored.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from engine.tensor_parallel.mappings import TPGroup
from engine.tensor_parallel.random import MasterWeightInit, scaled_init_std
from engine.transformer.rotary import apply_rotary_pos_emb
from ledger.config import ModelConfig


class SelfAttention(torch.nn.Module):
    def __init__(self, config: ModelConfig, prefix: str, *, tp: TPGroup, sequence_parallel: bool,
                 params_dtype: torch.dtype, device: torch.device | str, seed: int):
        super().__init__()
        n_q, n_kv, d = config.num_attention_heads, config.num_query_groups, config.head_dim
        if n_q % n_kv or n_kv % tp.size:
            raise ValueError(f"attention: {n_q} heads / {n_kv} query groups do not split over TP {tp.size}")
        self.head_dim = d
        self.heads_per_group = n_q // n_kv
        self.groups_per_partition = n_kv // tp.size
        std = config.init_method_std
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size, (n_q + 2 * n_kv) * d, tp=tp,
            init=MasterWeightInit(std, seed, f"{prefix}.linear_qkv.weight"), params_dtype=params_dtype,
            device=device, sequence_parallel=sequence_parallel)
        self.linear_proj = RowParallelLinear(
            n_q * d, config.hidden_size, tp=tp,
            init=MasterWeightInit(scaled_init_std(std, config.num_layers), seed, f"{prefix}.linear_proj.weight"),
            params_dtype=params_dtype, device=device, input_is_parallel=True, sequence_parallel=sequence_parallel)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        qkv = self.linear_qkv(hidden_states)  # [s, b, local groups x (heads per group + 2) x d]
        s, b, _ = qkv.shape
        qkv = qkv.view(s, b, self.groups_per_partition, self.heads_per_group + 2, self.head_dim)
        q, k, v = qkv.split((self.heads_per_group, 1, 1), dim=3)
        q = apply_rotary_pos_emb(q.reshape(s, b, -1, self.head_dim), cos, sin)
        k = apply_rotary_pos_emb(k.squeeze(3), cos, sin)
        v = v.squeeze(3)
        # SDPA wants [b, heads, s, d]; permute is a view.
        out = F.scaled_dot_product_attention(q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3),
                                             is_causal=True, enable_gqa=self.heads_per_group > 1)
        return self.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))
