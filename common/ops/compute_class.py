"""What kind of device work a kernel is, named the same on both sides of a reconciliation.

A step's device compute splits into the GEMMs (`matmul`: every linear's fprop, dgrad and wgrad, the experts' and the
router's, unfused attention's batched products), fused attention (`attention`: flash or cuDNN attention's forward and
backward), the optimizer's update (`optimizer`) and everything else (`other kernels`: norms, activations, RoPE, the
loss, copies, the grad-buffer memset). The first two are compute-bound, priced at the power limit's clocks; the
others move memory. The time model classes its catalogue entries by name (`kernel_class`); a trace's kernels are
classed by the op that launched them (ledger/evidence/compute_classes.py).
"""
from __future__ import annotations

from common.ops.kernel import Kernel
from common.ops.linear import GEMM_PASSES

MATMUL, ATTENTION, OPTIMIZER, OTHER = "matmul", "attention", "optimizer", "other kernels"
CLASSES = (MATMUL, ATTENTION, OPTIMIZER, OTHER)
FUSED_ATTENTION = "core_attention"  # core_attention.fwd / .bwd; unfused attention's parts have longer names


def kernel_class(k: Kernel) -> str:
    """matmul, attention or other for a pass's entry (the optimizer's update is a per-element rate, not an entry)."""
    base, _, suffix = k.name.rpartition(".")
    if suffix in GEMM_PASSES:
        return MATMUL
    if base == FUSED_ATTENTION:
        return ATTENTION
    return OTHER
