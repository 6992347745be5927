"""The decoder stack of one pipeline stage (or one virtual-pipeline chunk), and which layers it holds.

Megatron's TransformerBlock builds only its stage's layers, at an offset computed from the pipeline rank; layers
keep their global number, which names their init seeds, so a stage's weights equal the same layers' weights in a
single-process model. Stages after the first take their input from `set_input_tensor` (the schedule puts the
received activation there), not from forward's argument.

Full activation recompute (Megatron's _checkpointed_forward, --recompute-granularity full) runs groups of layers
under torch.utils.checkpoint (non-reentrant): a group keeps only its input, and its forward runs again in backward
when the first of its saved tensors is needed, TP collectives included. torch stops that re-run once the group's
last saved tensor exists (checkpoint early stop, its default), so the group's final fc2 all-reduce (reduce-scatter
under SP) is not repeated; the ledger's comm formula counts exactly that. The groups are cut per model chunk:
`recompute_segments`.
"""
from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from common.config import ModelConfig, RecomputeConfig
from engine.tensor_parallel.mappings import TPGroup
from engine.transformer.moe.moe_layer import MoEContext
from engine.transformer.rms_norm import RMSNorm
from engine.transformer.transformer_layer import TransformerLayer


def recompute_segments(num_layers: int, recompute: RecomputeConfig) -> list[tuple[int, int, bool]]:
    """The chunk's layers as (start, end, checkpointed) runs, in order (Megatron's _checkpointed_forward).

    uniform N: [0, N), [N, 2N), ... every one checkpointed, the last possibly shorter; block N: each of the first N
    layers checkpointed on its own, the rest one plain run; no full recompute: one plain run.
    """
    n, count = num_layers, recompute.recompute_num_layers
    if recompute.recompute_granularity != "full":
        return [(0, n, False)]
    if recompute.recompute_method == "uniform":
        return [(start, min(start + count, n), True) for start in range(0, n, count)]
    first = min(count, n)
    return [(i, i + 1, True) for i in range(first)] + ([(first, n, False)] if first < n else [])


class TransformerBlock(torch.nn.Module):
    def __init__(self, config: ModelConfig, layer_numbers: list[int], *, post_process: bool, tp: TPGroup,
                 sequence_parallel: bool, params_dtype: torch.dtype, device: torch.device | str, seed: int,
                 recompute: RecomputeConfig = RecomputeConfig(), moe: MoEContext | None = None):
        """moe: what MoE layers need (config.is_moe), handed to every layer."""
        super().__init__()
        self.layers = torch.nn.ModuleList(
            TransformerLayer(config, n, tp=tp, sequence_parallel=sequence_parallel, params_dtype=params_dtype,
                             device=device, seed=seed,
                             checkpoint_core_attention=recompute.recompute_granularity == "selective", moe=moe)
            for n in layer_numbers)
        self.segments = recompute_segments(len(self.layers), recompute)
        self.final_layernorm = (RMSNorm(config.hidden_size, config.norm_epsilon, sequence_parallel=sequence_parallel,
                                        params_dtype=params_dtype, device=device) if post_process else None)
        self.input_tensor: torch.Tensor | None = None

    def set_input_tensor(self, input_tensor: torch.Tensor | None) -> None:
        self.input_tensor = input_tensor

    def forward(self, hidden_states: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        for start, end, checkpointed in self.segments:
            if checkpointed:
                # No dropout: the forward draws no random numbers, so there is no RNG state to replay (Megatron
                # forks its CUDA RNG tracker for dropout under TP; we have nothing to fork).
                hidden_states = checkpoint(self._run_layers, start, end, hidden_states, cos, sin,
                                           use_reentrant=False, preserve_rng_state=False)
            else:
                hidden_states = self._run_layers(start, end, hidden_states, cos, sin)
        return self.final_layernorm(hidden_states) if self.final_layernorm is not None else hidden_states

    def _run_layers(self, start: int, end: int, hidden_states: torch.Tensor, cos: torch.Tensor,
                    sin: torch.Tensor) -> torch.Tensor:
        for layer in self.layers[start:end]:
            hidden_states = layer(hidden_states, cos, sin)
        return hidden_states
