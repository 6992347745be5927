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
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from common.config import RunConfig
from ledger.formulas.params import ParamTensor, chunk_tensors

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

    @property
    def numel_unpadded(self) -> int:
        return sum(end - start for start, end, _ in self.param_ranges.values())

    @property
    def padding(self) -> int:
        return self.numel - self.numel_unpadded


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


def megatron_bucket_size(cfg: RunConfig, pp_rank: int, chunk: int) -> int | None:
    t, dp = cfg.train, cfg.parallel.data_parallel_size
    if not t.overlap_grad_reduce or pp_rank > 0 or chunk > 0:
        return None
    return t.ddp_bucket_size if t.ddp_bucket_size is not None else max(40_000_000, 1_000_000 * dp)


def rank_buffers(cfg: RunConfig, pp_rank: int) -> list[BufferLayout]:
    """The buffers of one rank of pipeline rank `pp_rank`, one per model chunk (identical on every TP / DP rank)."""
    dp = cfg.parallel.data_parallel_size
    chunks = cfg.parallel.virtual_pipeline_model_parallel_size or 1
    return [layout_buffer(chunk_tensors(cfg, pp_rank, c), megatron_bucket_size(cfg, pp_rank, c), dp,
                          cfg.train.use_distributed_optimizer) for c in range(chunks)]


def shard_param_elements(layout: BufferLayout, dp: int, dp_rank: int) -> int:
    """Real (non-padding) elements of the distributed optimizer's shard on `dp_rank`: each bucket splits into dp
    equal contiguous ranges, rank r owning the r-th; main params and Adam state exist only for parameter elements
    inside the owned range (Megatron's `_build_model_gbuf_param_range_map`)."""
    owned = 0
    for bucket_id, (b_start, b_end) in enumerate(layout.buckets):
        size = (b_end - b_start) // dp
        lo, hi = b_start + dp_rank * size, b_start + (dp_rank + 1) * size
        owned += sum(max(0, min(end, hi) - max(start, lo))
                     for start, end, b in layout.param_ranges.values() if b == bucket_id)
    return owned
