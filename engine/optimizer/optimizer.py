"""MegatronOptimizer and the two non-sharded flavours (Megatron's optimizer.py; docs/engine.md).

Every optimizer here updates parameter *pieces*, not nn.Parameters: the elements of one parameter inside one range
of a DDP buffer that this rank updates. The subclasses only choose the ranges: the whole buffer (FP32Optimizer,
Float16OptimizerWithFloat16Params) or this rank's shard of each bucket (DistributedOptimizer), whose edges may cut a
parameter. Buffer padding is never a piece: as in Megatron, main params and Adam state exist for parameter elements
only.

Precision follows Megatron's MixedPrecisionOptimizer:
- main params: a piece of an fp32 param buffer is its own main param (fp32 training copies nothing); 16-bit pieces
  get fp32 copies at construction, views into one compact tensor (`main_param_storage`), copied back into the param
  buffer after each update (one foreach launch).
- main grads: a piece of an fp32 grad buffer is its own main grad (a view: Megatron's `.float()` of an fp32 tensor);
  16-bit pieces (--grad-reduce-in-bf16) are copied to fp32 at step time (Megatron's
  `_copy_model_grads_to_main_grads`), into one compact tensor that zero_grad() frees again (set_to_none). So the
  copy first exists after the first step, as the ledger's "after_first_step" phase counts it.

The inner optimizer is torch's AdamW (decoupled weight decay, as Megatron's Adam); 1-D parameters and biases get
no weight decay, Megatron's default. Fused kernels on CUDA, foreach elsewhere. The grad norm counts each gradient
element once: TP-duplicated parameters on TP rank 0 only, and of tied embeddings split over pipeline stages only the
first stage's copy (the last stage's is marked `shared`, Megatron's param_is_not_shared). In an MoE model the expert
buffers' pieces are the norm's second part, reduced over the expert groups (clip_grads).
"""
from __future__ import annotations

from typing import Any, Iterator

import torch

from common.config import TrainConfig
from engine.optimizer.clip_grads import (
    clip_grad_by_total_norm_fp32,
    get_grad_norm_fp32,
    param_is_not_shared,
    param_is_not_tensor_parallel_duplicate,
)
from probes.probe_set import NullProbeSet


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


def _fp32_views(pieces: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """An fp32 tensor per piece: the piece itself where it is fp32, else a view into one new compact fp32 tensor,
    returned too (None when no piece needed one). Allocates; copies nothing."""
    numel = sum(piece.numel() for piece in pieces if piece.dtype != torch.float32)
    if numel == 0:
        return list(pieces), None
    storage = torch.empty(numel, dtype=torch.float32, device=pieces[0].device)
    views, offset = [], 0
    for piece in pieces:
        if piece.dtype == torch.float32:
            views.append(piece)
        else:
            views.append(storage[offset:offset + piece.numel()])
            offset += piece.numel()
    return views, storage


def _copy_pieces(destinations: list[torch.Tensor], sources: list[torch.Tensor]) -> None:
    """destination <- source wherever the two are different tensors, converting dtype."""
    pairs = [(d, s) for d, s in zip(destinations, sources) if d is not s]
    if pairs:
        torch._foreach_copy_([d for d, _ in pairs], [s for _, s in pairs])


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
        # the run's probe set, which the engine hands every DDP chunk: it names the grad norm's collectives
        self.probes = model_chunks[0].probes if model_chunks else NullProbeSet()
        self.model_params: list[torch.Tensor] = []  # pieces of the param buffers
        self.model_grads: list[torch.Tensor] = []  # the same pieces of the grad buffers
        decays: list[bool] = []
        self.counts_for_norm: list[bool] = []
        self.is_expert: list[bool] = []  # the piece lies in an expert buffer
        # An MoE model's ranks all join the expert part of the norm, even one holding no expert piece.
        self.has_experts = "expt_mp" in parallel_state.groups
        for chunk in model_chunks:
            for buffer in chunk.buffers:
                for param, lo, hi in self._owned_pieces(buffer):
                    self.model_params.append(buffer.param_data[lo:hi])
                    self.model_grads.append(buffer.grad_data[lo:hi])
                    decays.append(not _no_weight_decay(chunk.param_to_name[param], param))
                    self.is_expert.append(buffer.expert)
                    self.counts_for_norm.append(param_is_not_shared(param) and
                                                param_is_not_tensor_parallel_duplicate(param, parallel_state.tp_rank))
        self.main_params, self.main_param_storage = _fp32_views(self.model_params)
        _copy_pieces(self.main_params, self.model_params)
        self.main_grad_storage: torch.Tensor | None = None
        self.device = model_chunks[0].buffers[0].param_data.device
        self.optimizer = torch.optim.AdamW(
            [{"params": [m for m, d in zip(self.main_params, decays) if d], "weight_decay": train.weight_decay},
             {"params": [m for m, d in zip(self.main_params, decays) if not d], "weight_decay": 0.0}],
            lr=train.lr, betas=(train.adam_beta1, train.adam_beta2), eps=train.adam_eps,
            **_kernel_flags(self.device))

    def _shard_bounds(self, buffer: Any) -> list[tuple[int, int]]:
        """The [start, end) ranges of `buffer` this rank updates: all of it unless sharded."""
        return [(0, buffer.numel)]

    def _owned_pieces(self, buffer: Any) -> Iterator[tuple[torch.nn.Parameter, int, int]]:
        """(param, start, end) in buffer elements of each parameter piece inside the ranges this rank updates."""
        ranges = [buffer.param_index_map[p] for p in buffer.params]
        for start, end in self._shard_bounds(buffer):
            for param, part in zip(buffer.params, shard_param_ranges(ranges, start, end)):
                if part is not None:
                    yield param, start + part[0], start + part[1]

    def _grad_stats_groups(self, expert: bool) -> list[tuple[str, Any]]:
        """The (kind, group) pairs one part's squared grad norm is summed over: those holding other elements of it."""
        kind = "expt_mp" if expert else "mp"
        return [(kind, self.parallel_state.groups[kind])]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    def zero_grad(self) -> None:
        """Megatron's set_to_none on the main grads: the fp32 copy of 16-bit grads is freed until the next step. The
        grads themselves are the DDP grad buffers, which model_chunk.zero_grad_buffer() clears."""
        for main_param in self.main_params:
            main_param.grad = None
        self.main_grad_storage = None

    def _copy_model_grads_to_main_grads(self) -> list[torch.Tensor]:
        main_grads, self.main_grad_storage = _fp32_views(self.model_grads)
        _copy_pieces(main_grads, self.model_grads)
        for main_param, main_grad in zip(self.main_params, main_grads):
            main_param.grad = main_grad
        return main_grads

    @torch.no_grad()
    def step(self) -> tuple[bool, float]:
        main_grads = self._copy_model_grads_to_main_grads()
        grad_norm = get_grad_norm_fp32([self._norm_part(main_grads, expert) for expert in
                                        ((False, True) if self.has_experts else (False,))], self.device,
                                       self.probes)
        if self.train.clip_grad > 0.0 and main_grads:
            clip_grad_by_total_norm_fp32(main_grads, self.train.clip_grad, grad_norm, self.optimizer)
        self.optimizer.step()
        _copy_pieces(self.model_params, self.main_params)
        self._sync_params()
        # The one host sync of the step, after every kernel and collective of it has been issued.
        return True, float(grad_norm)

    def _norm_part(self, main_grads: list[torch.Tensor], expert: bool) -> tuple[list[torch.Tensor],
                                                                                 list[tuple[str, Any]]]:
        """The dense (expert False) or expert grads that count for the norm, and the groups their sum spans."""
        grads = [g for g, counts, e in zip(main_grads, self.counts_for_norm, self.is_expert) if counts and e == expert]
        return grads, self._grad_stats_groups(expert)

    def _sync_params(self) -> None:
        """Make every rank's model params current after the update; replicas already are unless sharded."""

    def inventory(self) -> list[dict[str, Any]]:
        """What this optimizer allocates, and when: the fp32 main params at construction; the fp32 grad copy and
        torch's Adam m and v at the first step."""
        records = []
        if self.main_param_storage is not None:
            records.append(_record("optimizer.main_params", "master_params", self.main_param_storage.numel(),
                                   "after_optimizer_init", True))
        grad_copy = sum(g.numel() for g in self.model_grads if g.dtype != torch.float32)
        if grad_copy:
            records.append(_record("optimizer.main_grads", "master_grads", grad_copy, "after_first_step",
                                   self.main_grad_storage is not None))
        numel = sum(m.numel() for m in self.main_params)
        for moment in ("exp_avg", "exp_avg_sq"):
            records.append(_record(f"optimizer.adam.{moment}", f"adam_{moment}", numel, "after_first_step",
                                   bool(self.optimizer.state)))
        return records


def _record(name: str, kind: str, numel: int, allocated_at: str, exists: bool) -> dict[str, Any]:
    """Parameter elements only, so no padding (the DDP buffers' records carry theirs)."""
    return {"name": name, "kind": kind, "dtype": str(torch.float32), "numel": numel, "bytes": 4 * numel,
            "padding": 0, "allocated_at": allocated_at, "exists": exists}


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
