"""Bytes of static state per parameter, by sharding strategy and precision.

Convention (Megatron-LM's distributed-optimizer table, docs/user-guide/features/dist_optimizer.md): per parameter
of the model replica a rank holds (its TP-local, PP-local parameters), counting the model parameter, the main
gradient, the optimizer's fp32 main parameter (only when params are 16-bit: fp32 params are their own main copy),
the fp32 copy of the gradient the optimizer makes when the main gradient is 16-bit (Megatron's `.float()` on the
grad shard; this is why its fp16 row is 20 and not 16), and Adam's fp32 m and v. Activations, buffer padding and
temporaries are excluded. With d = data-parallel size:

    DDP     P + G + M + C + 8           (nothing sharded)
    ZeRO-1  P + G + (M + C + 8) / d     (Megatron's --use-distributed-optimizer)
    ZeRO-2  P + (G + M + C + 8) / d
    ZeRO-3  (P + G + M + C + 8) / d     (FSDP full sharding)

which gives Megatron's table: bf16/fp32-grad 18 and 6 + 12/d; fp16/fp16-grad 20 and 4 + 16/d; fp32 16 and 8 + 8/d.

torch's Adam creates m and v at the first `step()`, and the fp32 grad copy appears there too (Megatron makes it at
step time, `_copy_model_grads_to_main_grads`, and drops it at the next zero_grad): "after optimizer init" excludes
them, "after the first step" includes them; for bf16 with fp32 grads the difference is 8 bytes per sharded parameter
(8 / d per parameter under ZeRO-1).
"""
from __future__ import annotations

from dataclasses import dataclass

from common.config import RunConfig
from common.errors import ConfigError
from common.ops.sizes import DTYPE_BYTES
from ledger.models.formulas.buffer_layout import dp_cp_size

STRATEGIES = ("ddp", "zero1", "zero2", "zero3")
PHASES = ("after_optimizer_init", "after_first_step")


@dataclass(frozen=True)
class BytesPerParam:
    """Each component already divided by its sharding factor."""
    param: float
    grad: float
    master_param: float
    grad_fp32_copy: float
    adam_m: float
    adam_v: float

    @property
    def total(self) -> float:
        return self.param + self.grad + self.master_param + self.grad_fp32_copy + self.adam_m + self.adam_v


def master_param_bytes(param_dtype: str) -> int:
    """The optimizer's fp32 main copy exists only for 16-bit params (Megatron's MixedPrecisionOptimizer)."""
    return 0 if param_dtype == "fp32" else 4


def grad_copy_bytes(grad_dtype: str) -> int:
    """The fp32 grad the optimizer step reads: a copy when the main grad is 16-bit, a view when it is fp32."""
    return 0 if grad_dtype == "fp32" else 4


def bytes_per_param(param_dtype: str, grad_dtype: str, strategy: str, dp: int,
                    phase: str = "after_first_step") -> BytesPerParam:
    if strategy not in STRATEGIES:
        raise ConfigError(f"unknown sharding strategy {strategy!r} (one of {', '.join(STRATEGIES)})")
    if phase not in PHASES:
        raise ConfigError(f"unknown phase {phase!r} (one of {', '.join(PHASES)})")
    stepped = phase == "after_first_step"
    level = STRATEGIES.index(strategy)
    shard = {name: dp if level >= rank else 1 for name, rank in (("param", 3), ("grad", 2), ("optim", 1))}
    return BytesPerParam(
        param=DTYPE_BYTES[param_dtype] / shard["param"],
        grad=DTYPE_BYTES[grad_dtype] / shard["grad"],
        master_param=master_param_bytes(param_dtype) / shard["optim"],
        grad_fp32_copy=(grad_copy_bytes(grad_dtype) if stepped else 0) / shard["optim"],
        adam_m=(4 if stepped else 0) / shard["optim"],
        adam_v=(4 if stepped else 0) / shard["optim"],
    )


def run_strategy(cfg: RunConfig) -> str:
    """Our engine offers Megatron's two: DDP, or ZeRO-1 with --use-distributed-optimizer."""
    return "zero1" if cfg.train.use_distributed_optimizer else "ddp"


def run_bytes_per_param(cfg: RunConfig, phase: str = "after_first_step") -> BytesPerParam:
    t = cfg.train
    return bytes_per_param(t.params_dtype, t.grad_dtype, run_strategy(cfg), dp_cp_size(cfg), phase)
