"""One pre-norm decoder layer: h + attn(norm(h)), then h + mlp(norm(h)), as Megatron's TransformerLayer.

With experts (config.is_moe) the MLP is an MoELayer (router, all-to-all dispatch, this rank's experts, combine),
still named `mlp`, as in Megatron; `moe` carries its expert-parallel group and micro-batch count.

Under sequence parallelism h is [s/tp, b, h]: the norms and residual adds work on this rank's slice of the
sequence; the all-gather before and the reduce-scatter after each TP region live in the parallel linears.
"""
from __future__ import annotations

import torch

from common.config import ModelConfig
from engine.tensor_parallel.mappings import TPGroup
from engine.transformer.attention import SelfAttention
from engine.transformer.mlp import MLP
from engine.transformer.moe.moe_layer import MoEContext, MoELayer
from engine.transformer.rms_norm import RMSNorm


class TransformerLayer(torch.nn.Module):
    def __init__(self, config: ModelConfig, layer_number: int, *, tp: TPGroup, sequence_parallel: bool,
                 params_dtype: torch.dtype, device: torch.device | str, seed: int,
                 checkpoint_core_attention: bool = False, moe: MoEContext | None = None):
        """layer_number is the layer's global index (0-based) in the whole model; it names the init seeds.
        checkpoint_core_attention is selective recompute (see SelfAttention); moe is needed when config.is_moe."""
        super().__init__()
        self.layer_number = layer_number
        prefix = f"decoder.layers.{layer_number}"
        common = dict(tp=tp, sequence_parallel=sequence_parallel, params_dtype=params_dtype, device=device, seed=seed)
        norm = dict(sequence_parallel=sequence_parallel, params_dtype=params_dtype, device=device)
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_epsilon, **norm)
        self.self_attention = SelfAttention(config, f"{prefix}.self_attention", **common,
                                            checkpoint_core_attention=checkpoint_core_attention)
        self.pre_mlp_layernorm = RMSNorm(config.hidden_size, config.norm_epsilon, **norm)
        if config.is_moe:
            if moe is None:
                raise ValueError("an MoE layer needs its MoEContext (expert-parallel group, micro-batch count)")
            self.mlp = MoELayer(config, layer_number, moe=moe, tp=tp, params_dtype=params_dtype, device=device,
                                seed=seed)
        else:
            self.mlp = MLP(config, f"{prefix}.mlp", **common)

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attention(self.input_layernorm(hidden_states), cos, sin)
        return hidden_states + self.mlp(self.pre_mlp_layernorm(hidden_states))
