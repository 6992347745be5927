"""Buffer layout invariants: reverse order, padding rule, bucketing, shards tiling buckets, views sharing storage."""
from __future__ import annotations

import math

import pytest
import torch

from common.errors import ConfigError
from engine.distributed import DistributedDataParallel, DistributedDataParallelConfig
from engine.distributed.param_and_grad_buffer import build_buffer_layout, padding_rule
from engine.optimizer.optimizer import shard_param_ranges
from tests.support.gloo import run_distributed

W1, W2, WL = 6, 4, 12  # docs/buffer_layout.md's toy, in module order


def test_buffer_toy_layout_is_reversed_and_unpadded():
    layout = build_buffer_layout([W1, W2, WL], None, dp_size=2, use_distributed_optimizer=True,
                                 alignment_padding=False)
    assert layout.param_ranges == ((16, 22), (12, 16), (0, 12))
    assert layout.order == [2, 1, 0]
    assert (layout.numel, layout.padding) == (22, 0)
    assert layout.bucket_ranges == ((0, 22),)


def test_without_distributed_optimizer_nothing_is_padded():
    layout = build_buffer_layout([5, 7, 3], None, dp_size=4, use_distributed_optimizer=False)
    assert layout.param_ranges == ((10, 15), (3, 10), (0, 3))
    assert (layout.numel, layout.padding) == (15, 0)


def test_megatron_alignment_of_the_buffer_toy():
    # WL at 0; W2 starts at ceil(12/64)*64 = 64; W1 at ceil(68/64)*64 = 128, ends 134;
    # the bucket ends at ceil(134/lcm(2,128))*128 = 256.
    layout = build_buffer_layout([W1, W2, WL], None, dp_size=2, use_distributed_optimizer=True)
    assert layout.param_ranges == ((128, 134), (64, 68), (0, 12))
    assert (layout.numel, layout.padding) == (256, 256 - 22)


def test_bucket_end_multiple_is_lcm_of_dp_and_128():
    assert padding_rule(3, True, True) == (64, 384)
    assert padding_rule(256, True, True) == (64, 256)
    assert padding_rule(3, True, False) == (1, 3)
    assert padding_rule(3, False, True) == (1, 1)
    layout = build_buffer_layout([10], None, dp_size=3, use_distributed_optimizer=True)
    assert layout.numel == 384


def test_bucket_closes_once_it_reaches_bucket_size_and_params_never_split():
    # Reversed: p3 [0,5), p2 [5,10) -> 10 >= 10 closes bucket 0; p1 [10,15), p0 [15,35) closes bucket 1 (35-10 >= 10).
    layout = build_buffer_layout([20, 5, 5, 5], 10, dp_size=2, use_distributed_optimizer=False)
    assert layout.bucket_ranges == ((0, 10), (10, 35))
    assert layout.param_buckets == (1, 1, 0, 0)
    assert layout.param_ranges[0] == (15, 35)  # larger than a bucket, still whole


def test_aligned_buckets_start_where_the_previous_padded_bucket_ends():
    # dp=4: p3 [0,5); p2 starts 64 -> [64,69), 69 >= 10 closes at 128; p1 [128,133); p0 [192,197) -> end 256.
    layout = build_buffer_layout([5, 5, 5, 5], 10, dp_size=4, use_distributed_optimizer=True)
    assert layout.param_ranges == ((192, 197), (128, 133), (64, 69), (0, 5))
    assert layout.bucket_ranges == ((0, 128), (128, 256))
    assert layout.padding == 256 - 20


def test_a_shared_embedding_gets_a_bucket_of_its_own_under_the_distributed_optimizer():
    # First stage [embedding a (100, shared), b (30), c (200)], reversed: c [0, 200), b [256, 286); a would start at
    # 320, but the open bucket closes there (padded to 384 = 3 x lcm(2, 128)) and a's own bucket is [384, 512).
    first = build_buffer_layout([100, 30, 200], None, 2, True, shared_embedding=[True, False, False])
    assert first.param_ranges == ((384, 484), (256, 286), (0, 200))
    assert first.bucket_ranges == ((0, 384), (384, 512))
    # Last stage, its copy registered last so laid out first: a bucket of the same 128 elements, so DP rank r owns
    # the same 64 elements of the weight on both stages.
    last = build_buffer_layout([200, 30, 100], None, 2, True, shared_embedding=[False, False, True])
    assert last.param_ranges[2] == (0, 100) and last.bucket_ranges[0] == (0, 128)
    # Nothing is sharded without the distributed optimizer: no bucket of its own.
    assert build_buffer_layout([100, 30, 200], None, 2, False, shared_embedding=[True, False, False]).bucket_ranges \
        == ((0, 330),)


@pytest.mark.parametrize("dp_size,aligned", [(2, True), (3, True), (4, False), (8, True), (3, False)])
def test_shards_tile_every_bucket(dp_size, aligned):
    numels = [7, 130, 1, 64, 65, 300, 2]
    layout = build_buffer_layout(numels, 100, dp_size, use_distributed_optimizer=True, alignment_padding=aligned)
    for b, (start, end) in enumerate(layout.bucket_ranges):
        assert (end - start) % dp_size == 0
        start_multiple, end_multiple = padding_rule(dp_size, True, aligned)
        assert start % end_multiple == 0 and end % end_multiple == 0
        members = layout.bucket_params(b)
        covered = {i: 0 for i in members}
        size = (end - start) // dp_size
        for rank in range(dp_size):
            parts = shard_param_ranges([layout.param_ranges[i] for i in members], start + rank * size,
                                       start + (rank + 1) * size)
            for i, part in zip(members, parts):
                if part is not None:
                    lo, hi, p_lo, p_hi = part
                    assert hi - lo == p_hi - p_lo and 0 <= lo < hi <= size
                    covered[i] += hi - lo
        assert covered == {i: numels[i] for i in members}
    for i, (start, _) in enumerate(layout.param_ranges):
        assert start % padding_rule(dp_size, True, aligned)[0] == 0


def test_the_toy_shard_boundary_cuts_wl_at_element_11():
    ranges = [(16, 22), (12, 16), (0, 12)]  # W1, W2, WL
    assert shard_param_ranges(ranges, 0, 11) == [None, None, (0, 11, 0, 11)]
    assert shard_param_ranges(ranges, 11, 22) == [(5, 11, 0, 6), (1, 5, 0, 4), (0, 1, 11, 12)]


def test_overlap_param_gather_needs_the_distributed_optimizer():
    with pytest.raises(ConfigError, match="--use-distributed-optimizer"):
        DistributedDataParallelConfig(overlap_grad_reduce=True, overlap_param_gather=True)


def _views_share_storage(rank: int, world_size: int) -> dict:
    from engine.parallel_state import ParallelState

    ps = ParallelState.initialize()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 2, bias=False),
                                torch.nn.Linear(2, 6).to(torch.float64))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ddp = DistributedDataParallel(DistributedDataParallelConfig(use_distributed_optimizer=True), model, ps)
    out: dict = {"buffers": [], "values_kept": all(torch.equal(p, before[n]) for n, p in model.named_parameters())}
    for buffer in ddp.buffers:
        base_p, base_g = buffer.param_data.data_ptr(), buffer.grad_data.data_ptr()
        size = buffer.param_data.element_size()
        views = {}
        for p in buffer.params:
            start, end = buffer.param_index_map[p]
            views[ddp.param_to_name[p]] = ((p.data_ptr() - base_p) // size, p.main_grad.data_ptr() - base_g,
                                           start, end, p.main_grad.shape == p.shape)
        out["buffers"].append({"dtype": str(buffer.param_dtype), "numel": buffer.numel, "views": views,
                               "grad_itemsize": buffer.grad_data.element_size()})
    return out


@pytest.mark.slow
def test_params_and_main_grads_are_views_at_the_same_offset_per_dtype_buffer():
    out = run_distributed(_views_share_storage, 2)[0]
    assert out["values_kept"]
    by_dtype = {b["dtype"]: b for b in out["buffers"]}
    assert set(by_dtype) == {"torch.float32", "torch.float64"}
    fp32 = by_dtype["torch.float32"]
    # Reverse order: 1.weight (4) first, then 0.bias (2) and 0.weight (6), each start aligned to 64; end to 128.
    assert [fp32["views"][n][2] for n in ("1.weight", "0.bias", "0.weight")] == [0, 64, 128]
    assert fp32["numel"] == 256
    for start_p, grad_byte_offset, start, end, same_shape in fp32["views"].values():
        assert start_p == start and grad_byte_offset == start * fp32["grad_itemsize"] and same_shape
    assert by_dtype["torch.float64"]["numel"] == math.lcm(2, 128)
