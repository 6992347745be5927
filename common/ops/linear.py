"""A linear layer's three GEMMs, y = x W^T with W [out, inp] over `rows` rows (a layer's tokens, an expert's rows,
the router's routed tokens):

    fprop  [rows, inp] x [inp, out]   m = rows, n = out, k = inp
    dgrad  [rows, out] x [out, inp]   m = rows, n = inp, k = out
    wgrad  [out, rows] x [rows, inp]  m = out,  n = inp, k = rows  (accumulated into the grad-dtype main_grad, as
                                                                     the engine's gradient-accumulation fusion does)

2 m n k FLOPs each (a multiply-add is 2), the same product for all three. A grouped linear (--moe-grouped-gemm:
the rank's experts' weights as one [E, n, k] tensor, each row multiplied by its expert's) runs its fprop and dgrad
as one GEMM over all the experts' rows, keyed apart from a dense GEMM by `experts`, and its wgrad as each expert's own
GEMM over its rows: a dense linear's wgrad (GroupedLinear). An fp8 linear (--fp8-format: torchao's float8
matmul, engine/fp8_utils.py) is keyed apart by `fp8`: its fprop includes the casts of the input and the weight, its
dgrad and wgrad are its backward's (the casts of the output gradient and the operand; wgrad also DDP's hook adding
the 16-bit gradient into main_grad: fp8 has no gradient-accumulation fusion). Without gradient-accumulation fusion
(--no-gradient-accumulation-fusion, ours or Megatron-LM's) the wgrad writes a 16-bit gradient that DDP's hook adds
into main_grad after it: `main_grad.add`, keyed by the weight's elements.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.ops.kernel import Kernel, OpGroup, kernel

GEMM_PASSES = ("fprop", "dgrad", "wgrad")
MAIN_GRAD_ADD = "main_grad.add"
FP8 = "fp8"  # the dim that keys an fp8 linear's GEMMs apart (value 1)


def runs_in_fp8(k: Kernel) -> bool:
    """An fp8 linear's GEMM (--fp8-format): priced at the fp8 peak, timed through the engine's float8 matmul."""
    return dict(k.dims).get(FP8) == 1


def gemm(name: str, m: int, n: int, k: int, **group: int) -> Kernel:
    return kernel(name, 2.0 * m * n * k, **group, m=m, n=n, k=k)


def main_grad_add(wgrad: Kernel) -> Kernel:
    """DDP's hook adding a 16-bit `wgrad`'s [m, n] gradient into its main_grad (no gradient-accumulation fusion)."""
    d = dict(wgrad.dims)
    return kernel(MAIN_GRAD_ADD, numel=d["m"] * d["n"])


@dataclass(frozen=True)
class Linear(OpGroup):
    fprop: Kernel
    dgrad: Kernel
    wgrad: Kernel

    def direct(self) -> tuple[Kernel, ...]:
        """The GEMMs a caller runs without autograd: a dense linear's three; an fp8 linear's fprop alone (its dgrad
        and wgrad are its autograd function's backward)."""
        return (self.fprop,) if runs_in_fp8(self.fprop) else self.kernels()


def linear(name: str, rows: int, out: int, inp: int, *, fp8: bool = False) -> Linear:
    group = {FP8: 1} if fp8 else {}
    return Linear(fprop=gemm(f"{name}.fprop", rows, out, inp, **group),
                  dgrad=gemm(f"{name}.dgrad", rows, inp, out, **group),
                  wgrad=gemm(f"{name}.wgrad", out, inp, rows, **group))


@dataclass(frozen=True)
class GroupedLinear(OpGroup):
    """`experts.{name}`'s fprop and dgrad, each one grouped GEMM over all the experts' rows, and each expert's wgrad
    over its own rows: `{name}.wgrad`, one entry per distinct row count (rows, kernel)."""
    fprop: Kernel
    dgrad: Kernel
    wgrads: tuple[tuple[int, Kernel], ...]

    def wgrad(self, rows: int) -> Kernel:
        return dict(self.wgrads)[rows]

    def direct(self) -> tuple[Kernel, ...]:
        """The fprop alone: its dgrad and wgrads are its autograd function's backward."""
        return (self.fprop,)


def grouped_linear(name: str, experts: int, rows: int, out: int, inp: int,
                   expert_rows: tuple[int, ...]) -> GroupedLinear:
    """`experts` experts' linear `name` over `rows` rows in all, `expert_rows` the distinct rows an expert has
    (module docstring)."""
    return GroupedLinear(fprop=gemm(f"experts.{name}.fprop", rows, out, inp, experts=experts),
                         dgrad=gemm(f"experts.{name}.dgrad", rows, inp, out, experts=experts),
                         wgrads=tuple((r, linear(name, r, out, inp).wgrad) for r in expert_rows))
