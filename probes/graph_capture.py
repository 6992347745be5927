"""CUDA graph capture without autograd's stream-mismatch warning, where the mismatch is the capture's own.

torch.cuda.make_graphed_callables warms callables up on one side stream and captures them on another, while their
weights' AccumulateGrad nodes (kept alive by DDP's hooks, or by the caller's autograd graph) belong to the default
stream: autograd warned of the mismatch once a process, in every GPU run's output (H200, torch 2.11). The warning
stays on for everything else. A graphed model's steps still meet it: the capture keeps the nodes it made on its side
stream alive, and nodes made on the default stream beforehand make the capture fail (the legacy stream may not wait
on a capturing one), so there it is make_graphed_callables' own, as in Megatron-LM's graphed runs.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch


@contextmanager
def capture_stream_mismatch_quiet() -> Iterator[None]:
    """Autograd's AccumulateGrad stream-mismatch warning off inside, the caller's setting restored on the way out
    (on an error too)."""
    previous = torch._C._warn_on_accumulate_grad_stream_mismatch()
    torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(False)
    try:
        yield
    finally:
        torch.autograd.graph.set_warn_on_accumulate_grad_stream_mismatch(previous)
