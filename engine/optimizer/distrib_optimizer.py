"""DistributedOptimizer: ZeRO-1 by byte range of each bucket (Megatron's distrib_optimizer.py; docs/engine.md,
"Distributed optimizer").

Rank r of the DP group owns [r*n/dp, (r+1)*n/dp) of every bucket of n elements (the layout pads n to a multiple
of dp). The DP group is each buffer's own: dp x cp for dense buffers, the expert-data-parallel group for expert
buffers (MoE), whose shards and all-gathers therefore span expt_dp. It keeps fp32 main params and Adam's m and v
only for the parameter elements of that range (padding gets none), whose edges need not fall on parameter edges.
step(): the reduce-scattered grad shard becomes the main grads, clip, Adam, main params -> this rank's range of
param_data, then every bucket's param_data is all-gathered from its owners: synchronously here, or under
--overlap-param-gather asynchronously, the first bucket group's from zero_grad() and each next one when the forward
pre-hook has waited for the previous one.
"""
from __future__ import annotations

from typing import Any

from common.config import TrainConfig
from engine.optimizer.optimizer import MegatronOptimizer


class DistributedOptimizer(MegatronOptimizer):
    def __init__(self, train: TrainConfig, model_chunks: list[Any], parallel_state: Any):
        super().__init__(train, model_chunks, parallel_state)
        self.overlap_param_gather = model_chunks[0].ddp_config.overlap_param_gather

    def _shard_bounds(self, buffer: Any) -> list[tuple[int, int]]:
        dp_size, dp_rank = buffer.dp_size, buffer.data_parallel_group.rank()
        bounds = []
        for bucket in buffer.buckets:
            size = bucket.grad_data.numel() // dp_size
            bounds.append((bucket.offset + dp_rank * size, bucket.offset + (dp_rank + 1) * size))
        return bounds

    def _grad_stats_groups(self, expert: bool) -> list[tuple[str, Any]]:
        # Each DP rank holds a different shard of the gradients, so the (expert) DP group joins the norm's reduction.
        kind = "expt_dp" if expert else "dp_cp"
        return [*super()._grad_stats_groups(expert), (kind, self.parallel_state.groups[kind])]

    def zero_grad(self) -> None:
        """Also, under --overlap-param-gather, issue the all-gathers the first forward needs (the last bucket group
        of each chain, dense and expert, holds the first layers); the forward pre-hooks issue the rest in turn."""
        super().zero_grad()
        if self.overlap_param_gather:
            for head in self.model_chunks[0].param_gather_chain_heads:
                head.start_param_sync()

    def _sync_params(self) -> None:
        if not self.overlap_param_gather:
            for chunk in self.model_chunks:
                chunk.start_param_sync()
