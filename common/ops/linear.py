"""A linear layer's three GEMMs, y = x W^T with W [out, inp] over `rows` rows (a layer's tokens, an expert's rows,
the router's routed tokens):

    fprop  [rows, inp] x [inp, out]   m = rows, n = out, k = inp
    dgrad  [rows, out] x [out, inp]   m = rows, n = inp, k = out
    wgrad  [out, rows] x [rows, inp]  m = out,  n = inp, k = rows  (accumulated into the grad-dtype main_grad, as
                                                                     the engine's gradient-accumulation fusion does)

2 m n k FLOPs each (a multiply-add is 2), the same product for all three.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.ops.kernel import Kernel, OpGroup, kernel

GEMM_PASSES = ("fprop", "dgrad", "wgrad")


def gemm(name: str, m: int, n: int, k: int) -> Kernel:
    return kernel(name, 2.0 * m * n * k, m=m, n=n, k=k)


@dataclass(frozen=True)
class Linear(OpGroup):
    fprop: Kernel
    dgrad: Kernel
    wgrad: Kernel


def linear(name: str, rows: int, out: int, inp: int) -> Linear:
    return Linear(fprop=gemm(f"{name}.fprop", rows, out, inp), dgrad=gemm(f"{name}.dgrad", rows, inp, out),
                  wgrad=gemm(f"{name}.wgrad", out, inp, rows))
