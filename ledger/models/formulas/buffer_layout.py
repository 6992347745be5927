"""Megatron Core's contiguous param/grad buffer layout, element by element.

Rule (Megatron Core `_ParamAndGradBuffer` with `DistributedOptimizer._compute_per_buffer_param_layout` and
`optimizer/param_layout.py`; without the distributed optimizer `_compute_default_per_buffer_param_layout`):

1. One buffer per model chunk and (param dtype, grad dtype); our model has a single dtype pair, so one per chunk.
2. Parameters are laid out in reverse registration order (backprop order), one contiguous range each.
3. Distributed optimizer only: each parameter's start is rounded up to a multiple of 64 elements.
4. Buckets: a bucket closes right after the parameter whose end makes the bucket's running size
   (param end - bucket start) reach `bucket_size`; a parameter never splits. `bucket_size is None` is one bucket.
5. Distributed optimizer only: each bucket's end is rounded up to a multiple of lcm(dp, 128) (older Megatron: dp),
   and the next bucket starts there, so every bucket splits evenly into dp shards.
6. Distributed optimizer only: a shared embedding (tied embeddings under PP > 1, params.py) gets a bucket of its own:
   the open bucket closes where it would start, and its bucket closes right after it (Megatron's
   `_does_param_require_new_bucket`). Its bucket is then laid out alike on the first and the last stage, so each DP
   rank owns the same elements of both copies and the embedding all-reduce after the reduce-scatter adds matching
   shards.
7. Without the distributed optimizer nothing is padded.

`bucket_size` follows Megatron's DistributedDataParallel: --ddp-bucket-size or max(40,000,000, 1,000,000 x dp); None
(one bucket) when --overlap-grad-reduce is off, on pipeline ranks > 0, and for model chunks after the first.

Under context parallelism "dp" above is the size of the group the buffers are reduced over, Megatron's dp_cp group
(`get_data_parallel_group(with_context_parallel=True)`: the dp x cp ranks that hold the same parameters, each CP rank
having computed gradients over its own part of the sequence): the buffers' padding, the bucket size and the
distributed optimizer's shards all use dp x cp (DistributedDataParallel's intra_dp_cp_group; training.py's
bucket_size default). `dp_cp_size` is that size; at cp 1 it is dp.

Mixture of experts (Megatron's expert_parallel_buffers): the expert weights (params.ParamTensor.expert) of a model
chunk go into a buffer of their own, laid out by the same rule over the chunk's expert parameters alone, with "dp"
the expert-data-parallel size (world / (tp x ep x pp): the ranks holding the same experts, over which their gradients
are reduced and the distributed optimizer shards them): param starts at 64, bucket ends at lcm(expert dp, 128). The
bucket size is the dense one (Megatron's DistributedDataParallel passes one bucket_size, from dp x cp, to both kinds
of buffer). `rank_buffers` are the dense buffers, `expert_rank_buffers` the expert ones (none for a dense model).

Speed (a layout search evaluates thousands of configs, each with up to hundreds of DP ranks): a rank's buffers are
cached per the fields they depend on, and a layout's distributed-optimizer shards are counted for all DP ranks in one
walk over its parameters.
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

    for p in reversed(params):
        start = round_up(cursor, PARAM_ALIGNMENT) if distributed_optimizer else cursor
        own_bucket = distributed_optimizer and p.shared_embedding
        if own_bucket and open_bucket:
            bucket_start = start = close(start)
        end = start + p.numel
        ranges[p.name] = (start, end, len(buckets))
        open_bucket = True
        if own_bucket or (bucket_size is not None and end - bucket_start >= bucket_size):
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
                         p.expert_model_parallel_size, dp_cp_size(cfg), expert_dp_size(cfg) if expert else None,
                         t.use_distributed_optimizer, t.overlap_grad_reduce, t.ddp_bucket_size, pp_rank)


_MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig))


@functools.lru_cache(maxsize=4096)
def _rank_buffers(model: tuple, tp: int, pp: int, vpp: int | None, ep: int, dp: int, expert_dp: int | None,
                  distributed_optimizer: bool, overlap_grad_reduce: bool, ddp_bucket_size: int | None,
                  pp_rank: int) -> tuple[BufferLayout, ...]:
    """The dense buffers (expert_dp None) or the expert ones of a config rebuilt from exactly the fields the layout
    depends on (so the cache key is them); `dp` is the dense reduction group's size (dp x cp, which also sets the
    bucket size), so the rebuilt config has cp 1; expert buffers are padded and sharded over `expert_dp`."""
    cfg = RunConfig(model=ModelConfig(*model),
                    parallel=ParallelConfig(world_size=tp * pp * dp, tensor_model_parallel_size=tp,
                                            pipeline_model_parallel_size=pp, expert_model_parallel_size=ep,
                                            virtual_pipeline_model_parallel_size=vpp),
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
