"""DistributedDataParallelConfig: the DDP knobs Megatron derives from its command line."""
from __future__ import annotations

from dataclasses import dataclass

from common.config import TrainConfig, check_ddp_flags


def default_bucket_size(dp_size: int) -> int:
    """Megatron's default: at large DP a bucket's per-rank chunk must stay big enough to be bandwidth-bound."""
    return max(40_000_000, 1_000_000 * dp_size)


@dataclass
class DistributedDataParallelConfig:
    grad_reduce_in_fp32: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    use_distributed_optimizer: bool = False
    bucket_size: int | None = None  # elements; None -> default_bucket_size(dp_size)
    # Megatron always aligns under the distributed optimizer (param starts to 64 elements, bucket ends to
    # lcm(dp, 128)). Off keeps only what even sharding needs (bucket ends to a multiple of dp): the toy of
    # docs/buffer_layout.md.
    alignment_padding: bool = True

    def __post_init__(self) -> None:
        check_ddp_flags(use_distributed_optimizer=self.use_distributed_optimizer,
                        overlap_grad_reduce=self.overlap_grad_reduce,
                        overlap_param_gather=self.overlap_param_gather, bucket_size=self.bucket_size)

    @classmethod
    def from_train_config(cls, train: TrainConfig, dp_size: int) -> "DistributedDataParallelConfig":
        return cls(grad_reduce_in_fp32=train.grad_dtype == "fp32",
                   overlap_grad_reduce=train.overlap_grad_reduce,
                   overlap_param_gather=train.overlap_param_gather,
                   use_distributed_optimizer=train.use_distributed_optimizer,
                   bucket_size=train.ddp_bucket_size if train.ddp_bucket_size is not None
                   else default_bucket_size(dp_size))
