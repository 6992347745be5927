"""Megatron Core's contiguous param/grad buffer layout, element by element.

The details: docs/buffer_layout.md, "The ledger's derivation".
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from common.config import (
    ModelConfig,
    ParallelConfig,
    ProbeConfig,
    RunConfig,
    TrainConfig,
)
from common.config.pipeline_layers import PIPELINE_SPLIT_FIELDS
from ledger.models.formulas.params import ParamTensor, chunk_tensors

PARAM_ALIGNMENT = 64
BUCKET_ALIGNMENT = 128


@dataclass(frozen=True)
class BufferLayout:
    """param_ranges: name -> (start, end, bucket id); buckets: (start, end) with end padded."""
    param_ranges: dict[str, tuple[int, int, int]]
    buckets: list[tuple[int, int]]

    @property
    def numel(self) -> int:
        return self.buckets[-1][1] if self.buckets else 0

    @functools.cached_property
    def numel_unpadded(self) -> int:
        return sum(end - start for start, end, _ in self.param_ranges.values())

    @property
    def padding(self) -> int:
        return self.numel - self.numel_unpadded

    def owned_per_rank(self, dp: int) -> tuple[int, ...]:
        """shard_param_elements of every DP rank, computed once per dp (memoised on the instance)."""
        memo = self.__dict__.setdefault("_owned_per_rank", {})
        if dp not in memo:
            memo[dp] = _owned_per_rank(self, dp)
        return memo[dp]


def round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def bucket_end_multiple(dp: int) -> int:
    return math.lcm(dp, BUCKET_ALIGNMENT)


def layout_buffer(params: list[ParamTensor], bucket_size: int | None, dp: int,
                  distributed_optimizer: bool) -> BufferLayout:
    """Lay out `params` (registration order) as Megatron's buffer does; see the module docstring for the rule."""
    ranges: dict[str, tuple[int, int, int]] = {}
    buckets: list[tuple[int, int]] = []
    bucket_start = cursor = 0
    open_bucket = False

    def close(end: int) -> int:
        padded = round_up(end, bucket_end_multiple(dp)) if distributed_optimizer else end
        buckets.append((bucket_start, padded))
        return padded

    in_buffer_order = params[::-1]
    for i, p in enumerate(in_buffer_order):
        start = round_up(cursor, PARAM_ALIGNMENT) if distributed_optimizer else cursor
        own_bucket = distributed_optimizer and p.shared_embedding
        if own_bucket and open_bucket:
            bucket_start = start = close(start)
        end = start + p.numel
        ranges[p.name] = (start, end, len(buckets))
        open_bucket = True
        following = in_buffer_order[i + 1] if i + 1 < len(in_buffer_order) else None
        group_continues = p.bucket_group != "" and following is not None and following.bucket_group == p.bucket_group
        if own_bucket or (bucket_size is not None and end - bucket_start >= bucket_size and not group_continues):
            bucket_start = cursor = close(end)
            open_bucket = False
        else:
            cursor = end
    if open_bucket:
        close(cursor)
    return BufferLayout(param_ranges=ranges, buckets=buckets)


def dp_cp_size(cfg: RunConfig) -> int:
    """Ranks the grad buffers are reduced over and the distributed optimizer shards over: dp x cp (module
    docstring)."""
    return cfg.parallel.data_parallel_size * cfg.parallel.context_parallel_size


def megatron_bucket_size(cfg: RunConfig, pp_rank: int, chunk: int) -> int | None:
    t, dp = cfg.train, dp_cp_size(cfg)
    if not t.overlap_grad_reduce or pp_rank > 0 or chunk > 0:
        return None
    return t.ddp_bucket_size if t.ddp_bucket_size is not None else max(40_000_000, 1_000_000 * dp)


def rank_buffers(cfg: RunConfig, pp_rank: int) -> list[BufferLayout]:
    """The dense buffers of one rank of pipeline rank `pp_rank`, one per model chunk (identical on every TP / DP
    rank). Read-only: the layouts are shared between calls with the same layout-deciding fields."""
    return list(_cached_buffers(cfg, pp_rank, expert=False))


def expert_rank_buffers(cfg: RunConfig, pp_rank: int) -> list[BufferLayout]:
    """The expert buffers of one rank of pipeline rank `pp_rank`, one per model chunk, padded and sharded over the
    expert-data-parallel group (module docstring); [] for a dense model. The same on every EP rank (the names differ,
    not the shapes)."""
    return list(_cached_buffers(cfg, pp_rank, expert=True)) if cfg.model.is_moe else []


def expert_dp_size(cfg: RunConfig) -> int:
    """The ranks the expert buffers are reduced and sharded over (Megatron's expt_dp group)."""
    return cfg.parallel.expert_data_parallel_size


def _cached_buffers(cfg: RunConfig, pp_rank: int, expert: bool) -> tuple[BufferLayout, ...]:
    p, t = cfg.parallel, cfg.train
    return _rank_buffers(tuple(getattr(cfg.model, name) for name in _MODEL_FIELDS), p.tensor_model_parallel_size,
                         p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size,
                         tuple(getattr(p, name) for name in PIPELINE_SPLIT_FIELDS),
                         p.expert_model_parallel_size, dp_cp_size(cfg), expert_dp_size(cfg) if expert else None,
                         t.use_distributed_optimizer, t.overlap_grad_reduce, t.ddp_bucket_size, pp_rank)


_MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))


@functools.lru_cache(maxsize=4096)
def _rank_buffers(model: tuple, tp: int, pp: int, vpp: int | None, split: tuple, ep: int, dp: int,
                  expert_dp: int | None, distributed_optimizer: bool, overlap_grad_reduce: bool,
                  ddp_bucket_size: int | None, pp_rank: int) -> tuple[BufferLayout, ...]:
    """The dense buffers (expert_dp None) or the expert ones of a config rebuilt from exactly the fields the layout
    depends on (so the cache key is them); `split`: the fields that split the layers over the stages
    (PIPELINE_SPLIT_FIELDS, in order); `dp` is the dense reduction group's size (dp x cp, which also sets the bucket
    size), so the rebuilt config has cp 1; expert buffers are padded and sharded over `expert_dp`."""
    cfg = RunConfig(model=ModelConfig(*model),
                    parallel=ParallelConfig(world_size=tp * pp * dp, tensor_model_parallel_size=tp,
                                            pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                                            virtual_pipeline_model_parallel_size=vpp,
                                            **dict(zip(PIPELINE_SPLIT_FIELDS, split))),
                    train=TrainConfig(use_distributed_optimizer=distributed_optimizer,
                                      overlap_grad_reduce=overlap_grad_reduce, ddp_bucket_size=ddp_bucket_size),
                    probes=ProbeConfig())
    expert = expert_dp is not None
    return tuple(layout_buffer([t for t in chunk_tensors(cfg, pp_rank, c) if t.expert == expert],
                               megatron_bucket_size(cfg, pp_rank, c), expert_dp if expert else dp,
                               distributed_optimizer) for c in range(vpp or 1))


def shard_param_elements(layout: BufferLayout, dp: int, dp_rank: int) -> int:
    """Real (non-padding) elements of the distributed optimizer's shard on `dp_rank`: each bucket splits into dp
    equal contiguous ranges, rank r owning the r-th; main params and Adam state exist only for parameter elements
    inside the owned range (Megatron's `_build_model_gbuf_param_range_map`)."""
    return layout.owned_per_rank(dp)[dp_rank]


def _owned_per_rank(layout: BufferLayout, dp: int) -> tuple[int, ...]:
    """Each parameter's range cut at its bucket's shard boundaries: its first and last shard get the partial ends,
    the shards between them whole (added through a difference array, so the walk is O(params + dp)). Elements past
    dp equal shards (a bucket whose size dp does not divide: never under the distributed optimizer) belong to none."""
    owned, whole = [0] * dp, [0] * (dp + 1)
    for start, end, bucket in layout.param_ranges.values():
        b_start, b_end = layout.buckets[bucket]
        size = (b_end - b_start) // dp
        end = min(end, b_start + dp * size)
        if end <= start:
            continue
        first, last = (start - b_start) // size, (end - 1 - b_start) // size
        if first == last:
            owned[first] += end - start
            continue
        owned[first] += b_start + (first + 1) * size - start
        owned[last] += end - (b_start + last * size)
        whole[first + 1] += size
        whole[last] -= size
    running = 0
    for r in range(dp):
        running += whole[r]
        owned[r] += running
    return tuple(owned)
