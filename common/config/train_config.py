"""The training loop's flags: batch sizes, the optimizer and its schedule, precision, DDP, data; and their checks."""
from __future__ import annotations

from dataclasses import dataclass

from common.data_flags import parse_blend, parse_split
from common.errors import ConfigError


@dataclass
class TrainConfig:
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    train_iters: int = 10
    lr: float = 3e-4
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_style: str = "cosine"
    lr_decay_iters: int | None = None
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    bf16: bool = False
    fp16: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    ddp_bucket_size: int | None = None
    grad_reduce_in_bf16: bool = False
    seed: int = 1234
    mock_data: bool = True
    data_path: list[str] | None = None  # Megatron's --data-path: PREFIX, or a blend WEIGHT PREFIX WEIGHT PREFIX ...
    split: str = "969,30,1"  # Megatron's default --split (train,valid,test over the documents)
    data_cache_path: str | None = None  # Megatron's --data-cache-path; None: PREFIX/cache/ (engine.datasets.cache)
    log_interval: int = 1
    # Megatron's --deterministic-mode: deterministic kernels only (torch.use_deterministic_algorithms, a fixed cuBLAS
    # workspace), so that two runs of the same flags, and a run resumed from a checkpoint, give the same bits on GPU.
    deterministic_mode: bool = False

    @property
    def params_dtype(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"

    @property
    def grad_dtype(self) -> str:
        """Megatron accumulates and reduces grads in fp32 under --bf16 unless --grad-reduce-in-bf16."""
        if self.params_dtype == "fp32":
            return "fp32"
        return "bf16" if self.grad_reduce_in_bf16 else "fp32"


def check_train(t: TrainConfig) -> None:
    """Megatron's validate_args for the precision, data and DDP flags (their ranges: limits; the learning-rate
    schedule: check_lr_schedule)."""
    check_precision(t)
    if t.data_path is not None:
        parse_blend(t.data_path)  # the files themselves are checked by the engine's dataset builder
    parse_split(t.split)
    check_ddp_flags(use_distributed_optimizer=t.use_distributed_optimizer, overlap_grad_reduce=t.overlap_grad_reduce,
                    overlap_param_gather=t.overlap_param_gather, bucket_size=t.ddp_bucket_size)


def check_precision(t: TrainConfig) -> None:
    if t.bf16 and t.fp16:
        raise ConfigError("--bf16 and --fp16 are mutually exclusive")
    if t.fp16:
        raise ConfigError("--fp16 training (loss scaling) is not implemented; use --bf16")
    if t.grad_reduce_in_bf16 and not t.bf16:
        raise ConfigError("--grad-reduce-in-bf16 needs --bf16")


def check_ddp_flags(*, use_distributed_optimizer: bool, overlap_grad_reduce: bool, overlap_param_gather: bool,
                    bucket_size: int | None) -> None:
    """Megatron's validate_args for the DDP knobs: the all-gather only exists with the distributed optimizer, and its
    overlap rides on the same bucket machinery as the reduce overlap. Shared by the CLI check and the engine's
    DistributedDataParallelConfig, which can also be built directly."""
    if overlap_param_gather and not use_distributed_optimizer:
        raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer")
    if overlap_param_gather and not overlap_grad_reduce:
        raise ConfigError("--overlap-param-gather needs --overlap-grad-reduce")
    if bucket_size is not None and bucket_size < 1:
        raise ConfigError(f"--ddp-bucket-size must be >= 1, got {bucket_size}")


def check_lr_schedule(t: TrainConfig) -> None:
    """The warm-up ends before the decay does, and the decay ends at or below the peak."""
    decay_iters = t.lr_decay_iters if t.lr_decay_iters is not None else t.train_iters
    if t.lr_warmup_iters >= decay_iters:
        raise ConfigError(f"--lr-warmup-iters {t.lr_warmup_iters} must be < the decay length {decay_iters} "
                          "(--lr-decay-iters, else --train-iters)")
    if t.min_lr > t.lr:
        raise ConfigError(f"--min-lr {t.min_lr} is above --lr {t.lr}")
