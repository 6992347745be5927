"""jit_fuser: torch.compile for the model's small pointwise functions, on CUDA only (Megatron's megatron/core/jit.py).

Eager PyTorch runs SwiGLU, the RoPE rotation and the cross-entropy passes as chains of kernels, each reading and
writing the whole activation (and, for the loss, an fp32 copy of the [s, b, V] logits). Compiled by inductor, each
decorated function becomes one or two kernels each way, with fp32 arithmetic in registers and one rounding to the
activation dtype. The functions stay plain PyTorch: they run eagerly on CPU (tests stay fast, and exact against
the unfused formulas) and everywhere when TRAIN_LEDGER_COMPILE=0, so that a benchmark can measure both.

Shapes are fixed for a run, so each function compiles once (static shapes) at its first CUDA call, in step 1; the
compiled object is built lazily because building it imports dynamo, which costs seconds in every process. The one
exception is an MoE expert's input, whose row count (the tokens routed to it) changes every micro-batch: a function
wrapped with dynamic_rows=True marks its input's rows dynamic and compiles once for every count instead of once per
count (which would hit dynamo's recompile limit within a step). Only the rows: torch.compile's dynamic=True would
make every dimension symbolic, and a kernel that splits a row at a symbolic width divides by it per element.
"""
from __future__ import annotations

import functools
from typing import Callable

import torch

from common.config.implementation_config import jit_fuser_compile_from_environment

# Device types on which jit_fuser's functions run compiled; TRAIN_LEDGER_COMPILE=0 leaves none (the run's config
# records the same choice: ImplementationConfig.jit_fuser_compile).
COMPILE_DEVICE_TYPES = {"cuda"} if jit_fuser_compile_from_environment() else set()


@functools.cache
def compiled(fn: Callable) -> Callable:
    """torch.compile(fn) with static shapes but for the dimensions an input marks dynamic."""
    return torch.compile(fn, fullgraph=True, dynamic=False)


def jit_fuser(fn: Callable, *, dynamic_rows: bool = False) -> Callable:
    """fn, compiled when its first argument lives on a device in COMPILE_DEVICE_TYPES, else eager; dynamic_rows: the
    first argument's dimension 0 varies from call to call, its other dimensions do not (module docstring)."""

    @functools.wraps(fn)
    def dispatch(*args):
        if args[0].device.type not in COMPILE_DEVICE_TYPES:
            return fn(*args)
        if dynamic_rows:
            torch._dynamo.maybe_mark_dynamic(args[0], 0)  # "maybe": rows 0 and 1 may still get their own graphs
        return compiled(fn)(*args)

    return dispatch
