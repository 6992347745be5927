"""SwiGLU compiled three ways, forward and backward timed on the device: which formulation moves its bytes fastest.

Split into gate and up by chunk (the engine's formulation until 2026-12-03), inductor writes the backward's [t, 2f]
gradient as one pointwise cat, each element computed by its own thread, so gate and dy are read twice (~1.4x the
least bytes: read gate, up, dy, write both halves). Variants:
  engine      the engine's function as it runs (engine/transformer/mlp.py: gate and up as the two rows of a
              [t, 2, f] view, the gradient as their stack; static shapes, rows marked dynamic for the MoE shape)
  chunk       gate and up by chunk
  concat      the chunk function compiled with inductor's pointwise cat off (max_pointwise_cat_inputs=0)
Each at the dense llama3.2-1b shape (4,096 x 16,384) and an MoE expert's (1,024 x 28,672, rows dynamic), timed by the
compute sweep's harness (probes/compute_sweep/harness.py: the device's time; a backward's forward untimed): the
forward, the backward, and the least bytes over the backward's time.

    python runs/bench/swiglu_kernels.py [--iters 50]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.transformer.mlp import swiglu, swiglu_any_rows  # noqa: E402
from probes.compute_sweep.calls import Backward, Call  # noqa: E402
from probes.compute_sweep.harness import median_seconds  # noqa: E402


def _chunk(gate_and_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_and_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def _concat(gate_and_up: torch.Tensor) -> torch.Tensor:
    """_chunk under a code object of its own, so that dynamo keeps the two compilations apart."""
    return _chunk(gate_and_up)


def variants(dynamic_rows: bool) -> dict[str, Callable]:
    def marked(fn: Callable) -> Callable:
        def call(x: torch.Tensor) -> torch.Tensor:
            if dynamic_rows:
                torch._dynamo.maybe_mark_dynamic(x, 0)
            return fn(x)
        return call

    return {"engine": swiglu_any_rows if dynamic_rows else swiglu,
            "chunk": marked(torch.compile(_chunk, fullgraph=True, dynamic=False)),
            "concat": marked(torch.compile(_concat, fullgraph=True, dynamic=False,
                                           options={"max_pointwise_cat_inputs": 0}))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--scale", type=int, default=1, help="divide the shapes' rows by this (a CPU smoke run)")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    for label, rows, width, dynamic in (("dense", 4096, 16384, False), ("moe expert", 1024, 28672, True)):
        rows //= a.scale
        x = torch.randn(rows, width, device=device, dtype=dtype, requires_grad=True)
        dy = torch.randn(rows, width // 2, device=device, dtype=dtype)
        reference = torch.autograd.grad(_chunk(x), x, dy)[0]
        least = 5 * rows * (width // 2) * x.element_size()  # read gate, up, dy; write both halves
        for name, fn in variants(dynamic).items():
            got = torch.autograd.grad(fn(x), x, dy)[0]
            same = torch.allclose(got.float(), reference.float(), rtol=2e-2, atol=2e-2)
            fwd = median_seconds(Call(lambda fn=fn: fn(x)), 3, a.iters, cuda)
            bwd = median_seconds(Backward(lambda fn=fn: fn(x), (x,), (dy,)), 3, a.iters, cuda)
            print(f"{label:10s} {name:8s} rows {rows} width {width}: forward {fwd * 1e6:7.1f} us, backward "
                  f"{bwd * 1e6:7.1f} us ({least / bwd / 1e12:.2f} TB/s of the least bytes), gradient as the eager "
                  f"one's: {same}", flush=True)
    print(f"torch {torch.__version__}; command: python {' '.join(sys.argv)}")


if __name__ == "__main__":
    main()
