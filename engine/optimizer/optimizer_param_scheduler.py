"""OptimizerParamScheduler: Megatron's learning-rate schedule (linear warmup, then decay to min_lr).

Steps count iterations here (Megatron counts samples and steps by global batch; with warmup and decay lengths
given in iterations the two are the same schedule). As in Megatron the constructor applies step 0, so under warmup
the first iteration trains with init_lr (0 by default).
"""
from __future__ import annotations

import math
from typing import Any

from common.config import TrainConfig
from common.errors import ConfigError

DECAY_STYLES = ("constant", "linear", "cosine")


class OptimizerParamScheduler:
    def __init__(self, optimizer: Any, init_lr: float, max_lr: float, min_lr: float, lr_warmup_steps: int,
                 lr_decay_steps: int, lr_decay_style: str):
        if lr_decay_style not in DECAY_STYLES:
            raise ConfigError(f"--lr-decay-style {lr_decay_style!r}: one of {', '.join(DECAY_STYLES)}")
        if not 0.0 <= min_lr <= max_lr:
            raise ConfigError(f"--min-lr {min_lr} must lie in [0, --lr {max_lr}]")
        if lr_decay_steps <= 0:
            raise ConfigError(f"lr decay length must be > 0 iterations, got {lr_decay_steps}")
        if not 0 <= lr_warmup_steps < lr_decay_steps:
            raise ConfigError(f"--lr-warmup-iters {lr_warmup_steps} must be < the decay length {lr_decay_steps}")
        self.optimizer = optimizer
        self.init_lr, self.max_lr, self.min_lr = init_lr, max_lr, min_lr
        self.lr_warmup_steps, self.lr_decay_steps = lr_warmup_steps, lr_decay_steps
        self.lr_decay_style = lr_decay_style
        self.num_steps = 0
        self.step(0)

    @classmethod
    def from_train_config(cls, optimizer: Any, train: TrainConfig) -> "OptimizerParamScheduler":
        decay = train.lr_decay_iters if train.lr_decay_iters is not None else train.train_iters
        return cls(optimizer, init_lr=0.0, max_lr=train.lr, min_lr=train.min_lr,
                   lr_warmup_steps=train.lr_warmup_iters, lr_decay_steps=decay, lr_decay_style=train.lr_decay_style)

    def get_lr(self) -> float:
        if self.lr_warmup_steps > 0 and self.num_steps <= self.lr_warmup_steps:
            return self.init_lr + (self.max_lr - self.init_lr) * self.num_steps / self.lr_warmup_steps
        if self.lr_decay_style == "constant":
            return self.max_lr
        if self.num_steps > self.lr_decay_steps:
            return self.min_lr
        ratio = (self.num_steps - self.lr_warmup_steps) / (self.lr_decay_steps - self.lr_warmup_steps)
        coeff = 1.0 - ratio if self.lr_decay_style == "linear" else 0.5 * (math.cos(math.pi * ratio) + 1.0)
        return self.min_lr + coeff * (self.max_lr - self.min_lr)

    def step(self, increment: int = 1) -> float:
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr
