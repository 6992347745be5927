"""An MLP's kernels: linear_fc1, its activation, linear_fc2, over a layer's tokens (the dense MLP) or an expert's
rows (an MoE layer's, moe.py).

The activation runs on fc1's output: the fused SwiGLU (gate and up, 2f wide) or, in the GPT style, Megatron's
bias_gelu (f wide, the bias add fused in); dims tokens (the rows) and width (fc1's). Megatron-LM without
--bias-swiglu-fusion runs SwiGLU unfused (megatron.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from common.ops.kernel import OpGroup, Passes, passes
from common.ops.linear import GroupedLinear, Linear, grouped_linear, linear
from common.ops.megatron import unfused_swiglu
from common.ops.shapes import ExpertShapes, Shapes


@dataclass(frozen=True)
class MLPOps(OpGroup):
    fc1: Linear | GroupedLinear
    activation: Passes
    fc2: Linear | GroupedLinear


def mlp_ops(sh: Shapes) -> MLPOps:
    unfused = sh.megatron is not None and sh.megatron.unfused_swiglu
    activation = (unfused_swiglu(sh, sh.tokens, sh.fc1) if unfused
                  else passes("swiglu" if sh.swiglu else "gelu", tokens=sh.tokens, width=sh.fc1))
    return MLPOps(fc1=linear("linear_fc1", sh.tokens, sh.fc1, sh.hidden, fp8=sh.fp8), activation=activation,
                  fc2=linear("linear_fc2", sh.tokens, sh.hidden, sh.ffn, fp8=sh.fp8))


def expert_ops(x: ExpertShapes, hidden: int, rows: int) -> MLPOps:
    """One SwiGLU expert at its row count: the dense MLP's kernels, keyed by their dims."""
    return MLPOps(fc1=linear("linear_fc1", rows, x.fc1, hidden), activation=passes("swiglu", tokens=rows, width=x.fc1),
                  fc2=linear("linear_fc2", rows, hidden, x.ffn))


def grouped_expert_ops(x: ExpertShapes, hidden: int) -> MLPOps:
    """The rank's experts under --moe-grouped-gemm: each linear's fprop and dgrad one grouped GEMM
    (`experts.linear_fc1`, ...) and its wgrads each expert's (at the experts' row counts), one SwiGLU over all the
    grouped rows."""
    rows, n = x.grouped_rows, x.local_experts
    return MLPOps(fc1=grouped_linear("linear_fc1", n, rows, x.fc1, hidden, x.row_counts),
                  activation=passes("swiglu", tokens=rows, width=x.fc1),
                  fc2=grouped_linear("linear_fc2", n, rows, hidden, x.ffn, x.row_counts))
