"""The MoE layer that replaces a transformer layer's MLP when the model has experts (Megatron's MoELayer):
router -> dispatch -> this rank's experts -> combine, on the layer's [s, b, h] input flattened to T = s b tokens.

It runs at tp = 1 and cp = 1 (check_engine_support refuses the rest). Under --moe-grouped-gemm the experts are a
GroupedMLP and, at EP 1, the dispatcher keeps the counts on the device: nothing in the layer waits for the device.
`MoEContext` is what it needs beyond the model config, built once per model chunk: the expert-parallel group (with
the probes its all-to-alls report to) and the schedule's number of micro-batches (the load-balancing loss's
gradient scale, router.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from common.config import ModelConfig
from engine.tensor_parallel.mappings import TPGroup
from engine.transformer.moe.expert_parallel import EPGroup
from engine.transformer.moe.experts import GroupedMLP, SequentialMLP
from engine.transformer.moe.router import TopKRouter
from engine.transformer.moe.routing_record import RoutingRecord
from engine.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
from probes.protocol import ProbeSetProtocol


@dataclass(frozen=True)
class MoEContext:
    ep: EPGroup
    num_microbatches: int = 1

    @classmethod
    def from_parallel_state(cls, parallel_state: Any, probes: ProbeSetProtocol | None = None,
                            num_microbatches: int = 1) -> "MoEContext":
        return cls(ep=EPGroup.from_parallel_state(parallel_state, probes), num_microbatches=num_microbatches)


class MoELayer(torch.nn.Module):
    def __init__(self, config: ModelConfig, layer_number: int, *, moe: MoEContext, tp: TPGroup,
                 params_dtype: torch.dtype, device: torch.device | str, seed: int):
        super().__init__()
        if tp.size != 1:
            raise ValueError(f"the MoE layer runs at tensor-parallel size 1, not {tp.size}")
        self.layer_number = layer_number
        prefix = f"decoder.layers.{layer_number}.mlp"
        self.router = TopKRouter(config, f"{prefix}.router", num_microbatches=moe.num_microbatches,
                                 params_dtype=params_dtype, device=device, seed=seed)
        experts = GroupedMLP if config.moe_grouped_gemm else SequentialMLP
        self.experts = experts(config, prefix, ep_size=moe.ep.size, ep_rank=moe.ep.rank, tp=tp,
                               params_dtype=params_dtype, device=device, seed=seed)
        self.token_dispatcher = MoEAlltoAllTokenDispatcher(config.num_experts, moe.ep, layer_number,
                                                           keep_counts_on_device=config.moe_grouped_gemm)
        self.record = RoutingRecord(config.num_experts)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        tokens = hidden_states.reshape(-1, hidden_states.shape[-1])
        routing = self.router(tokens)
        self.record.add(routing)
        rows, rows_per_expert, plan = self.token_dispatcher.dispatch(tokens, routing)
        return self.token_dispatcher.combine(self.experts(rows, rows_per_expert), plan).view_as(hidden_states)


def moe_step_figures(model: list[torch.nn.Module]) -> dict[str, Any]:
    """The step record's MoE figures from every MoE layer of this rank's model chunks; nothing for a dense model."""
    layers = [m for chunk in model for m in chunk.modules() if isinstance(m, MoELayer)]
    if not layers:
        return {}
    tokens, dropped, rows, aux_loss = {}, {}, {}, 0.0
    for layer in layers:
        tokens[str(layer.layer_number)], dropped[str(layer.layer_number)], aux = layer.record.take()
        aux_loss += aux
        if run := layer.experts.take_rows_run():  # SequentialMLP's (the grouped GEMMs' rows stay on the device)
            rows[str(layer.layer_number)] = run
    figures = {"moe_tokens_per_expert": tokens, "moe_dropped_tokens": dropped, "moe_aux_loss": aux_loss}
    return figures | ({"moe_expert_rows": rows} if rows else {})
