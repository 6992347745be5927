"""Causal self-attention with grouped-query attention (GQA), as Megatron's SelfAttention: no biases.

Fused QKV layout (Megatron's): the master linear_qkv weight [(n_q + 2 n_kv) d, h] is ordered by query group,

    [ q heads of group 0 (n_q/n_kv heads x d) | k_0 (d) | v_0 (d) | q heads of group 1 | k_1 | v_1 | ... ]

so the plain contiguous TP split of its rows (stride 1) gives each TP rank whole query groups: rank r holds groups
[r n_kv/tp, (r+1) n_kv/tp) with their own K and V, and attention needs no communication. Query head j of local
group g is local head g (n_q/n_kv) + j, which is the head order SDPA's enable_gqa expects (query head i reads KV
head i // (n_q/n_kv)).

Attention runs through F.scaled_dot_product_attention with is_causal=True (flash attention on GPU), so no s x s
score matrix is stored. Splitting the fused QKV and rotating q and k is one jit_fuser function: compiled on GPU it
writes q, k and v contiguous in one pass and dL/dQKV in the fused layout in one or two, instead of a reshape copy,
RoPE's chain of kernels for q and for k, and a concatenation of the three gradients.

Selective recompute (--recompute-granularity selective, Megatron's checkpoint_core_attention) runs the SDPA call
under torch.utils.checkpoint and redoes it in backward. What that frees here is small, because flash attention
already keeps no s x s scores: SDPA's saved q, k and v stay alive as the checkpoint's inputs, and its output stays
alive as linear_proj's saved input, so only the fp32 logsumexp (4 bytes per head per token) goes. The rest of the
layer is unchanged. docs/formulas.md ("Recompute") has the accounting; tests/test_recompute.py measures it.

Under context parallelism (set_context_parallel, called by the model for C > 1) core attention is ring attention
(engine/transformer/ring_attention.py) over the CP group instead of SDPA; the checkpoint wraps it the same way, so a
selective re-run repeats its forward ring exchanges. With C = 1 the SDPA call is untouched.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.checkpoint import checkpoint

from common.config import ModelConfig
from common.config.implementation_config import FLASH, FUSED
from engine.jit import jit_fuser
from engine.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from engine.tensor_parallel.mappings import TPGroup
from engine.tensor_parallel.random import MasterWeightInit, scaled_init_std
from engine.transformer.ring_attention import CPGroup, ring_attention
from engine.transformer.rotary import apply_rotary_pos_emb


@jit_fuser
def split_qkv_and_rotate(qkv: torch.Tensor, cos: torch.Tensor,
                         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [s, b, groups x heads per group, d], k and v [s, b, groups, d], contiguous, RoPE applied to q and k, from
    the fused QKV viewed as [s, b, groups, heads per group + 2, d].

    v is copied too (1 / heads-per-group of q's size): SDPA saves v for backward, and a view would keep the whole
    QKV output alive until then; the copy lets it be freed after the forward.
    """
    s, b, groups, width, d = qkv.shape
    q, k, v = qkv.split((width - 2, 1, 1), dim=3)
    q = apply_rotary_pos_emb(q.reshape(s, b, groups * (width - 2), d), cos, sin)
    k = apply_rotary_pos_emb(k.squeeze(3), cos, sin)
    return q, k, v.squeeze(3).contiguous()


def scaled_dot_product(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, gqa: bool, backend: str) -> torch.Tensor:
    """Causal SDPA on [b, heads, s, d]: torch's pick of kernel (flash), or on CUDA cuDNN's fused attention
    (--attention-backend fused), which is the only kernel allowed then: a call it cannot take fails, not falls back."""
    if backend == FUSED and q.is_cuda:
        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)


def set_attention_backend(chunks: list[torch.nn.Module], backend: str) -> None:
    """Every SelfAttention of the model chunks runs its core attention with `backend` (--attention-backend)."""
    for module in (m for chunk in chunks for m in chunk.modules()):
        if isinstance(module, SelfAttention):
            module.attention_backend = backend


class SelfAttention(torch.nn.Module):
    def __init__(self, config: ModelConfig, prefix: str, *, tp: TPGroup, sequence_parallel: bool,
                 params_dtype: torch.dtype, device: torch.device | str, seed: int,
                 checkpoint_core_attention: bool = False):
        super().__init__()
        self.checkpoint_core_attention = checkpoint_core_attention
        self.context_parallel: CPGroup | None = None
        self.attention_backend = FLASH  # set_attention_backend
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
        q, k, v = split_qkv_and_rotate(
            qkv.view(s, b, self.groups_per_partition, self.heads_per_group + 2, self.head_dim), cos, sin)
        # SDPA wants [b, heads, s, d]; permute is a view.
        q, k, v = q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3)
        if self.checkpoint_core_attention:
            # No dropout, so no RNG state to replay (see transformer_block).
            out = checkpoint(self.core_attention, q, k, v, use_reentrant=False, preserve_rng_state=False)
        else:
            out = self.core_attention(q, k, v)
        return self.linear_proj(out.permute(2, 0, 1, 3).reshape(s, b, -1))

    def set_context_parallel(self, cp: CPGroup) -> None:
        """Attend over the whole sequence of the CP group's ranks (ring attention) when the group has more than one."""
        self.context_parallel = cp if cp.size > 1 else None

    def core_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """softmax(q k^T / sqrt(d), causal) v on [b, heads, s, d]; GQA reads KV head i // heads per group."""
        if self.context_parallel is not None:
            return ring_attention(q, k, v, self.context_parallel)
        return scaled_dot_product(q, k, v, self.heads_per_group > 1, self.attention_backend)
