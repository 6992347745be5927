"""Run the engine's jit_fuser functions compiled on CPU, as they run on a GPU, for tests of what they compute or keep.

`backend` is a dynamo backend: inductor (the GPU's, with C++ kernels here; slow to compile), or
"aot_eager_decomp_partition", which splits forward from backward with inductor's min-cut partitioner (so autograd
keeps the tensors it keeps under inductor) and runs the graphs eagerly (fast).
"""
from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import pytest
import torch

from engine import jit


def _fresh() -> None:
    torch._dynamo.reset()
    jit.compiled.cache_clear()


@contextlib.contextmanager
def compiled_as_on_gpu(backend: str | object = "inductor") -> Iterator[None]:
    """jit_fuser compiles on CPU through `backend` inside the block; no compiled function outlives it."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(jit, "COMPILE_DEVICE_TYPES", {"cpu"})
        mp.setattr(torch, "compile", functools.partial(torch.compile, backend=backend))
        _fresh()
        try:
            yield
        finally:
            _fresh()
