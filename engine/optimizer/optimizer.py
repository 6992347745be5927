"""MegatronOptimizer and the two non-sharded flavours (Megatron's optimizer.py; docs/engine.md).

Every optimizer here works on contiguous ranges of the DDP buffers, not on the nn.Parameters: a range's fp32 main
copy (`main_params`) and fp32 gradient (`main_grads`) are one tensor each, and each parameter's main param is a
view into them. So the per-step copies are one kernel per range (grad buffer -> main grads, main params -> param
buffer), and where the model is already fp32 the "copy" is the buffer itself and costs nothing. The subclasses only
choose the ranges: the whole buffer (FP32Optimizer, Float16OptimizerWithFloat16Params) or this rank's shard of each
bucket (DistributedOptimizer).

The inner optimizer is torch's AdamW (decoupled weight decay, as Megatron's Adam); 1-D parameters and biases get
no weight decay, Megatron's default. Fused kernels on CUDA, foreach elsewhere.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from common.config import TrainConfig
from engine.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    get_grad_norm_fp32,
    param_is_not_tensor_parallel_duplicate,
)


def shard_param_ranges(param_ranges: list[tuple[int, int]], shard_start: int,
                       shard_end: int) -> list[tuple[int, int, int, int] | None]:
    """Per param (buffer range [s, e)): its part in the shard as (local start, local end, param start, param end).

    Local offsets are relative to the shard, param offsets to the parameter's first element; None when the param
    has no element in the shard. A shard boundary may cut a parameter.
    """
    out: list[tuple[int, int, int, int] | None] = []
    for start, end in param_ranges:
        lo, hi = max(start, shard_start), min(end, shard_end)
        out.append((lo - shard_start, hi - shard_start, lo - start, hi - start) if lo < hi else None)
    return out


@dataclass
class _MainShard:
    """One contiguous buffer range this optimizer updates; main_* alias model_* where the buffer is fp32."""
    model_params: torch.Tensor
    model_grads: torch.Tensor
    main_params: torch.Tensor
    main_grads: torch.Tensor
    numel_params: int  # elements that belong to parameters; the rest of the range is padding

    @classmethod
    def of(cls, buffer: Any, start: int, end: int, numel_params: int) -> "_MainShard":
        model_params, model_grads = buffer.param_data[start:end], buffer.grad_data[start:end]
        # .float() returns the tensor itself when it is already fp32: then main and model are one memory.
        return cls(model_params, model_grads, model_params.float(), model_grads.float(), numel_params)


def _kernel_flags(device: torch.device) -> dict[str, bool]:
    return {"fused": True} if device.type == "cuda" else {"foreach": True}


def _no_weight_decay(name: str, param: torch.nn.Parameter) -> bool:
    return name.endswith(".bias") or param.ndim == 1


class MegatronOptimizer:
    """zero_grad(); step() -> (update_successful, grad_norm); param_groups with a settable "lr"; inventory()."""

    def __init__(self, train: TrainConfig, model_chunks: list[Any], parallel_state: Any):
        self.train = train
        self.model_chunks = model_chunks
        self.parallel_state = parallel_state
        self.shards: list[_MainShard] = []
        self.grads_for_norm: list[torch.Tensor] = []
        decay: list[torch.Tensor] = []
        no_decay: list[torch.Tensor] = []
        for chunk in model_chunks:
            for buffer in chunk.buffers:
                ranges = [buffer.param_index_map[p] for p in buffer.params]
                for start, end in self._shard_bounds(buffer):
                    parts = shard_param_ranges(ranges, start, end)
                    owned = [(p, part) for p, part in zip(buffer.params, parts) if part is not None]
                    shard = _MainShard.of(buffer, start, end, sum(part[1] - part[0] for _, part in owned))
                    self.shards.append(shard)
                    for param, (lo, hi, _, _) in owned:
                        main = shard.main_params[lo:hi]
                        main.grad = shard.main_grads[lo:hi]
                        (no_decay if _no_weight_decay(chunk.param_to_name[param], param) else decay).append(main)
                        if param_is_not_tensor_parallel_duplicate(param, parallel_state.tp_rank):
                            self.grads_for_norm.append(main.grad)
        self.device = self.shards[0].main_params.device
        self.optimizer = torch.optim.AdamW(
            [{"params": decay, "weight_decay": train.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps,
            **_kernel_flags(self.device))

    def _shard_bounds(self, buffer: Any) -> list[tuple[int, int]]:
        """The [start, end) ranges of `buffer` this rank updates: all of it unless sharded."""
        return [(0, buffer.numel)]

    def _grad_stats_groups(self) -> list[Any]:
        return [self.parallel_state.groups["mp"]]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        """Nothing to clear: main grads are the DDP grad buffers (or refilled from them), which
        model_chunk.zero_grad_buffer() clears at the start of the step."""

    @torch.no_grad()
    def step(self) -> tuple[bool, float]:
        for shard in self.shards:
            if shard.main_grads is not shard.model_grads:
                shard.main_grads.copy_(shard.model_grads)
        grad_norm = get_grad_norm_fp32(self.grads_for_norm, self._grad_stats_groups(), self.device)
        if self.train.clip_grad > 0.0:
            clip_grad_by_total_norm_fp32([s.main_grads for s in self.shards], self.train.clip_grad, grad_norm)
        self.optimizer.step()
        for shard in self.shards:
            if shard.main_params is not shard.model_params:
                shard.model_params.copy_(shard.main_params)
        self._sync_params()
        # The one host sync of the step, after every kernel and collective of it has been issued.
        return True, float(grad_norm)

    def _sync_params(self) -> None:
        """Make every rank's model params current after the update; replicas already are unless sharded."""

    def inventory(self) -> list[dict[str, Any]]:
        """What this optimizer allocated, and when: torch's Adam creates m and v at the first step."""
        records = []
        for kind, main_attr, model_attr in (("master_params", "main_params", "model_params"),
                                            ("master_grads", "main_grads", "model_grads")):
            copies = [s for s in self.shards if getattr(s, main_attr) is not getattr(s, model_attr)]
            if copies:
                numel = sum(getattr(s, main_attr).numel() for s in copies)
                records.append(_record(f"optimizer.{main_attr}", kind, numel,
                                       numel - sum(s.numel_params for s in copies), "after_optimizer_init", True))
        numel = sum(p.numel() for group in self.optimizer.param_groups for p in group["params"])
        for moment in ("exp_avg", "exp_avg_sq"):
            records.append(_record(f"optimizer.adam.{moment}", f"adam_{moment}", numel, 0, "after_first_step",
                                   bool(self.optimizer.state)))
        return records


def _record(name: str, kind: str, numel: int, padding: int, allocated_at: str, exists: bool) -> dict[str, Any]:
    return {"name": name, "kind": kind, "dtype": str(torch.float32), "numel": numel, "bytes": 4 * numel,
            "padding": padding, "allocated_at": allocated_at, "exists": exists}


class FP32Optimizer(MegatronOptimizer):
    """fp32 training: the main params are the param buffer and the main grads the grad buffer; no copies."""

    def __init__(self, train: TrainConfig, model_chunks: list[Any], parallel_state: Any):
        assert all(b.param_dtype == torch.float32 for c in model_chunks for b in c.buffers), "fp32 params expected"
        super().__init__(train, model_chunks, parallel_state)


class Float16OptimizerWithFloat16Params(MegatronOptimizer):
    """bf16 params with a full fp32 master copy of every parameter on every DP rank (no sharding)."""

    def __init__(self, train: TrainConfig, model_chunks: list[Any], parallel_state: Any):
        assert all(b.param_dtype in (torch.bfloat16, torch.float16) for c in model_chunks for b in c.buffers), \
            "16-bit params expected"
        super().__init__(train, model_chunks, parallel_state)
