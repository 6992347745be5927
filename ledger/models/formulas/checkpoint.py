"""Bytes of one rank's checkpoint file (engine/checkpointing.py), predicted from the config.

What a rank's `torch.save` file holds, tensor by tensor (read engine.checkpointing.Checkpointer._state):
- its model chunks' param buffers, padding included (an MoE model's expert buffers too): static_memory's
  `param_buffer`;
- the fp32 main-param storage when params are 16-bit (fp32 params are their own main params, nothing is copied):
  `master_params`, over the elements this rank's optimizer owns (its shard's real elements under the distributed
  optimizer, every parameter element otherwise);
- torch AdamW's state per optimizer piece (one piece per parameter, or per parameter part inside the rank's shard
  of each bucket): exp_avg and exp_avg_sq, fp32, static_memory's `adam_m` and `adam_v`, and `step`, a 0-d fp32
  tensor (4 bytes) per piece;
- the torch CPU generator's state, a uint8 tensor of TORCH_CPU_RNG_STATE_BYTES.
Everything else is pickled inside the container, not a tensor: the scheduler's step count, the data positions, the
iteration, Python's random state (625 ints), the param groups' hyperparameters.

What the container adds (`CONTAINER_FIXED_BYTES`, `CONTAINER_BYTES_PER_TENSOR`): torch.save writes a zip archive
of data.pkl (the pickled structure above: about 6 KB on the tiny model, 3-4 KB of it Python's random state) plus one
uncompressed record per tensor storage, each with a 30-byte local header, its name, padding up to torch's 64-byte
storage alignment and a 46-byte central directory entry; plus a few version records. Measured on the tiny model
(DP2, distributed optimizer, bf16): 13.0 KB over 36 records and 10.8 KB over 27, about 240 bytes a record beyond a
fixed ~4.4 KB. On CUDA the file also holds each visible device's generator state (16 bytes and a record each).
The tolerance is this overhead, bounded from above: an absolute `CONTAINER_FIXED_BYTES` plus
`CONTAINER_BYTES_PER_TENSOR` per tensor (twice what was measured, room for eight CUDA generators and longer pickled
figures), so it stays the same few tens of KB whether the model has megabytes or gigabytes; a relative one would
hide a missing Adam moment on a large model.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from common.config import RunConfig
from ledger.models.formulas.buffer_layout import (
    BufferLayout,
    dp_cp_size,
    expert_dp_size,
    expert_rank_buffers,
    rank_buffers,
)
from ledger.models.formulas.static_memory import expert_dp_rank_of, static_bytes

TORCH_CPU_RNG_STATE_BYTES = 5056  # torch.get_rng_state(): the CPU generator's mt19937 state, as a uint8 tensor
ADAM_STEP_BYTES = 4  # torch's Adam keeps `step` as a 0-d fp32 tensor per parameter (piece)
CONTAINER_FIXED_BYTES = 32 * 1024
CONTAINER_BYTES_PER_TENSOR = 512


@dataclass(frozen=True)
class CheckpointBytes:
    """One rank's checkpoint file: the tensors it holds, by component, and how many tensors (storages) that is."""
    param_buffers: int
    main_params: int
    adam_m: int
    adam_v: int
    adam_step: int
    rng: int
    tensors: int

    @property
    def total(self) -> int:
        return self.param_buffers + self.main_params + self.adam_m + self.adam_v + self.adam_step + self.rng

    @property
    def container_tolerance(self) -> int:
        """Bytes the zip container and the pickle may add to `total` (module docstring)."""
        return CONTAINER_FIXED_BYTES + CONTAINER_BYTES_PER_TENSOR * self.tensors

    def to_dict(self) -> dict[str, int]:
        return {**asdict(self), "total": self.total}


def _pieces_in(layout: BufferLayout, ranges: list[tuple[int, int]]) -> int:
    """Parameters with at least one element inside one of `ranges` (buffer elements [start, end))."""
    return sum(1 for start, end, _ in layout.param_ranges.values()
               if any(min(end, hi) > max(start, lo) for lo, hi in ranges))


def optimizer_pieces(cfg: RunConfig, pp_rank: int, dp_rank: int) -> int:
    """The rank's optimizer pieces (engine.optimizer: each parameter's part inside a range the rank updates): every
    parameter, or under the distributed optimizer each parameter that has elements in the rank's shard of its
    bucket (a bucket splits into dp x cp equal contiguous shards, buffer_layout.shard_param_elements; an expert
    bucket into expert-dp shards, of which the rank owns its expert-dp index's)."""
    expert_rank = expert_dp_rank_of(cfg, dp_rank)
    return (_pieces(cfg, rank_buffers(cfg, pp_rank), dp_cp_size(cfg), dp_rank)
            + _pieces(cfg, expert_rank_buffers(cfg, pp_rank), expert_dp_size(cfg), expert_rank))


def _pieces(cfg: RunConfig, layouts: list[BufferLayout], dp: int, dp_rank: int) -> int:
    total = 0
    for layout in layouts:
        if not cfg.train.use_distributed_optimizer:
            total += _pieces_in(layout, [(0, layout.numel)])
            continue
        for start, end in layout.buckets:
            size = (end - start) // dp
            total += _pieces_in(layout, [(start + dp_rank * size, start + (dp_rank + 1) * size)])
    return total


def checkpoint_bytes(cfg: RunConfig, tp_rank: int, pp_rank: int, dp_rank: int) -> CheckpointBytes:
    """The tensors of one rank's checkpoint file, after at least one step (Adam's state exists)."""
    static = static_bytes(cfg, tp_rank, pp_rank, dp_rank, phase="after_first_step")
    pieces = optimizer_pieces(cfg, pp_rank, dp_rank)
    buffers = len(rank_buffers(cfg, pp_rank)) + len(expert_rank_buffers(cfg, pp_rank))
    return CheckpointBytes(param_buffers=static.param_buffer, main_params=static.master_params,
                           adam_m=static.adam_m, adam_v=static.adam_v, adam_step=pieces * ADAM_STEP_BYTES,
                           rng=TORCH_CPU_RNG_STATE_BYTES,
                           tensors=buffers + (1 if static.master_params else 0) + 3 * pieces + 1)
