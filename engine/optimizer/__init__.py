"""Optimizers for the training loop (Megatron Core's megatron/core/optimizer/)."""
from __future__ import annotations

from typing import Any

from common.config import TrainConfig
from common.errors import ConfigError
from engine.optimizer.distrib_optimizer import DistributedOptimizer
from engine.optimizer.optimizer import (
    Float16OptimizerWithFloat16Params,
    FP32Optimizer,
    MegatronOptimizer,
)
from engine.optimizer.optimizer_param_scheduler import OptimizerParamScheduler

__all__ = ["DistributedOptimizer", "Float16OptimizerWithFloat16Params", "FP32Optimizer", "MegatronOptimizer",
           "OptimizerParamScheduler", "get_megatron_optimizer"]


def get_megatron_optimizer(train: TrainConfig, model_chunks: list[Any], parallel_state: Any) -> MegatronOptimizer:
    """One optimizer over every model chunk (one DDP per virtual pipeline stage)."""
    if train.fp16:
        raise ConfigError("--fp16 needs a dynamic loss scaler, which this engine does not implement; use --bf16")
    for chunk in model_chunks:
        if chunk.ddp_config.use_distributed_optimizer != train.use_distributed_optimizer:
            raise ConfigError("the DDP buffers and the optimizer disagree on --use-distributed-optimizer")
    if train.use_distributed_optimizer:
        return DistributedOptimizer(train, model_chunks, parallel_state)
    if train.bf16:
        return Float16OptimizerWithFloat16Params(train, model_chunks, parallel_state)
    return FP32Optimizer(train, model_chunks, parallel_state)
