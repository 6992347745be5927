"""Megatron-LM's local GPT layer with torch's scaled_dot_product_attention as its core attention, for Megatron-LM's
`--spec megatron_sdpa_spec layer_spec` (gpt_builders.py imports `layer_spec` from this module).

Why: without Transformer Engine, Megatron-LM's only core attention is DotProductAttention, which materialises the
[b, heads, s, s] scores; its flash path (--attention-backend flash / fused) is Transformer Engine's. This module
keeps every other submodule of Megatron's local spec (get_gpt_layer_local_spec: ColumnParallelLinear,
RowParallelLinear, torch norms, unfused RoPE, the MLP) and swaps DotProductAttention for `SDPAttention`, which takes
the same arguments and calls torch's scaled_dot_product_attention exactly as this repository's engine does
(is_causal, GQA by enable_gqa, so K and V are never repeated; on an H200 in bf16 torch picks flash attention). What
it keeps for backward is what flash attention keeps: q, k, v, the output and the fp32 logsumexp (docs/formulas.md,
"Megatron-LM's saved set"); the ledger recognises this spec by its module name (common/megatron/implementation.py).
Causal masking is the kernel's: the dataloader's attention mask is not read.

Run by runs/megatron/lm_h200_cases.sh with this folder on PYTHONPATH; it imports Megatron-LM and torch, so it
is not part of the train-ledger packages.
"""
from __future__ import annotations

import torch.nn.functional as F
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.training import get_args


class SDPAttention(MegatronModule):
    """DotProductAttention's interface, flash attention's work: [sq, b, heads, d] q and [sk, b, groups, d] k, v in,
    [sq, b, heads d] out. The output's permute and reshape are views ([b, s, heads, d] is flash attention's own
    layout), so linear_proj saves the very tensor flash attention saved."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                 softmax_scale=None, cp_comm_type=None, pg_collection=None):
        super().__init__(config=config)
        assert config.context_parallel_size == 1, "SDPAttention: no context parallelism"
        self.dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        self.scale = softmax_scale  # None: 1 / sqrt(d), as DotProductAttention's default

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        assert packed_seq_params is None and attention_bias is None, "SDPAttention: no packed sequences or bias"
        sq, b, heads, d = query.shape
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True,
                                             scale=self.scale, enable_gqa=key.shape[2] != heads)
        return out.permute(2, 0, 1, 3).reshape(sq, b, heads * d)


def _layer_spec() -> ModuleSpec:
    args = get_args()
    spec = get_gpt_layer_local_spec(normalization=args.normalization, qk_layernorm=args.qk_layernorm)
    spec.submodules.self_attention.submodules.core_attention = SDPAttention
    return spec


layer_spec = _layer_spec()
