"""A timed call and what the op families build theirs from: random tensors of the run's dtype on the device, from a
private generator (the run's own random stream is untouched), the rank's shapes and the engine's functions."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from common.ops import Shapes
from probes.compute_sweep.handles import EngineKernels


class Op:
    """A timed call: `setup` runs untimed before each `run` (a backward's forward)."""

    def setup(self) -> None:
        pass

    def run(self) -> None:
        raise NotImplementedError


class Call(Op):
    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn

    def run(self) -> None:
        self.fn()


class Backward(Op):
    """The gradients of `inputs` from `forward()`'s outputs and fixed output gradients, through torch.autograd.grad
    (nothing accumulates into .grad between calls); `after` gets them and is timed too (DDP's main_grad add)."""

    def __init__(self, forward: Callable[[], Any], inputs: tuple[torch.Tensor, ...],
                 grads: tuple[torch.Tensor, ...], after: Callable[[tuple[torch.Tensor, ...]], None] | None = None):
        self.forward, self.inputs, self.grads, self.after = forward, inputs, grads, after
        self.outputs: tuple[torch.Tensor, ...] = ()

    def setup(self) -> None:
        outputs = self.forward()
        self.outputs = outputs if isinstance(outputs, tuple) else (outputs,)

    def run(self) -> None:
        grads = torch.autograd.grad(self.outputs, self.inputs, self.grads)
        self.outputs = ()
        if self.after is not None:
            self.after(grads)


class Tensors:
    """Random tensors of one device and dtype from a private generator."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.gen = torch.Generator(device=device).manual_seed(0)

    def randn(self, *shape: int, dtype: torch.dtype | None = None, grad: bool = False) -> torch.Tensor:
        t = torch.randn(*shape, generator=self.gen, device=self.device, dtype=dtype or self.dtype)
        return t.requires_grad_(grad)

    def ids(self, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=self.gen, device=self.device)


@dataclass(frozen=True)
class Bench:
    """What a family's builders make their timed calls of."""
    shapes: Shapes
    tensors: Tensors
    kernels: EngineKernels
    grad_dtype: torch.dtype


Builder = Callable[[dict[str, int]], Op]  # an entry's dims -> its timed call
