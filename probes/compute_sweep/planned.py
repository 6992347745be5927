"""The sweep's plan: every catalogue entry of the rank's stage (SweepSpec.ops) mapped to a timed call of its
family (gemm, attention, elementwise, moe, ends, rates; Megatron-LM's unfused chains: megatron), at its dims and
dtype. The plan is the catalogue's list
and nothing else: an entry no family can time is an error, not a gap the time model finds later."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from common.ops import GEMM_PASSES, Kernel
from probes.bandwidth import to_dtype
from probes.compute_sweep import attention, elementwise, ends, gemm, megatron, moe, rates
from probes.compute_sweep.calls import Bench, Builder, Op, Tensors
from probes.compute_sweep.handles import EngineKernels
from probes.compute_sweep.spec import SweepSpec


@dataclass(frozen=True)
class Planned:
    op: str
    dims: dict[str, int]
    dtype: str
    flops: float
    build: Callable[[], Op]
    sustained: bool = False  # one of the layer's kernels the power-limit record runs back to back


def _families(b: Bench) -> dict[str, Builder]:
    """Every family's builders by entry name (the GEMMs apart: by pass)."""
    sh = b.shapes
    if sh.moe is not None and b.kernels.moe is None:
        raise ValueError("an MoE model's sweep needs the engine's MoE kernels (EngineKernels.moe)")
    if sh.cp > 1 and b.kernels.ring is None:
        raise ValueError("a context-parallel sweep needs the engine's ring attention (EngineKernels.ring)")
    return {**elementwise.builders(b), **ends.builders(b), **rates.builders(b),
            **(attention.dense(b) if sh.cp == 1 else attention.ring(b)),
            **(moe.builders(b) if sh.moe is not None else {}),
            **(megatron.builders(b) if sh.megatron is not None else {})}


def _builder(k: Kernel, families: dict[str, Builder], gemms: dict[str, Builder]) -> Builder:
    """The entry's own family's by name (the grouped expert GEMMs among them), else a GEMM's by pass."""
    pass_ = k.name.rpartition(".")[2]
    found = families.get(k.name) or (gemms[pass_] if pass_ in GEMM_PASSES else None)
    if found is None:
        raise ValueError(f"the compute sweep has no timed call for {k.describe()}")
    return found


def plan(spec: SweepSpec, device: torch.device, kernels: EngineKernels) -> list[Planned]:
    """Every op this rank's stage runs, with its dims and a builder of its timed call: the catalogue's kernels at
    the run's dtype, then the per-element work at its own dtype and up to RATE_NUMEL_CAP elements."""
    ops, sh = spec.ops, spec.shapes
    b = Bench(sh, Tensors(device, to_dtype(sh.dtype)), kernels, to_dtype(sh.grad_dtype))
    families, gemms, sustained = _families(b), gemm.builders(b), set(ops.layer.sustained())
    out = [Planned(k.name, k.record_dims(), sh.dtype, k.flops, functools.partial(_builder(k, families, gemms),
                                                                                 k.record_dims()), k in sustained)
           for k in ops.kernels()]
    for rate, numel in ((ops.optimizer, spec.optimizer_numel), (ops.grad_buffer, spec.grad_buffer_numel)):
        dims = {"numel": min(numel, rates.RATE_NUMEL_CAP)}
        out.append(Planned(rate.name, dims, rate.dtype, 0.0, functools.partial(families[rate.name], dims)))
    return out
