"""jit_fuser: torch.compile for the model's small pointwise functions, on CUDA only (Megatron's megatron/core/jit.py).

Eager PyTorch runs SwiGLU, the RoPE rotation and the cross-entropy passes as chains of kernels, each reading and
writing the whole activation (and, for the loss, an fp32 copy of the [s, b, V] logits). Compiled by inductor, each
decorated function becomes one or two kernels each way, with fp32 arithmetic in registers and one rounding to the
activation dtype. The functions stay plain PyTorch: they run eagerly on CPU (tests stay fast, and exact against
the unfused formulas) and everywhere when TRAIN_LEDGER_COMPILE=0, so that a benchmark can measure both.

Shapes are fixed for a run, so each function compiles once (dynamic=False) at its first CUDA call, in step 1; the
compiled object is built lazily because building it imports dynamo, which costs seconds in every process. The one
exception is an MoE expert's input, whose row count (the tokens routed to it) changes every micro-batch: a function
wrapped with dynamic=True compiles once with a symbolic row count instead of once per count (which would hit
dynamo's recompile limit within a step).
"""
from __future__ import annotations

import functools
import os
from typing import Callable

import torch

# Device types on which jit_fuser's functions run compiled; TRAIN_LEDGER_COMPILE=0 leaves none.
COMPILE_DEVICE_TYPES = {"cuda"} if os.environ.get("TRAIN_LEDGER_COMPILE", "1") != "0" else set()


@functools.cache
def compiled(fn: Callable, dynamic: bool = False) -> Callable:
    return torch.compile(fn, fullgraph=True, dynamic=dynamic)


def jit_fuser(fn: Callable, *, dynamic: bool = False) -> Callable:
    """fn, compiled when its first argument lives on a device in COMPILE_DEVICE_TYPES, else eager; dynamic: shapes
    vary from call to call (module docstring)."""

    @functools.wraps(fn)
    def dispatch(*args):
        return (compiled(fn, dynamic) if args[0].device.type in COMPILE_DEVICE_TYPES else fn)(*args)

    return dispatch
