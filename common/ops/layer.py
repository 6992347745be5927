"""A decoder layer's kernels on one rank (Megatron's TransformerLayer): its norms (input_layernorm and
pre_mlp_layernorm, one kernel: same dims), self-attention (attention.py), the residual adds, and its MLP (mlp.py) or
MoE layer (moe.py).

rms_norm (layer_norm in the GPT style) and residual_add run on norm_tokens rows of h: the sequence-parallel shard.

SUSTAINED is the compute sweep's record of `sustained()` back to back on a GPU at its power limit: the layer's
GEMMs (the router's apart; a grouped linear's forward alone, Linear.direct), its core attention forward and its
forward elementwise kernels, the mix whose compute-bound part a training step slows (docs/formulas.md, "Time
model").
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from common.ops.attention import SelfAttentionOps, self_attention_ops
from common.ops.kernel import Kernel, OpGroup, Passes, kernel, passes
from common.ops.mlp import MLPOps, mlp_ops
from common.ops.moe import MoEOps, moe_ops
from common.ops.shapes import Shapes

SUSTAINED = "sustained.layer"


@dataclass(frozen=True)
class LayerOps(OpGroup):
    norm: Passes
    attention: SelfAttentionOps
    residual_add: Kernel
    mlp: MLPOps | None  # the dense MLP
    moe: MoEOps | None  # or the MoE layer

    @property
    def mlps(self) -> tuple[MLPOps, ...]:
        """The MLPs a layer runs: the dense one, or the MoE layer's (MoEOps.mlps)."""
        return (self.mlp,) if self.mlp is not None else self.moe.mlps

    def sustained(self) -> tuple[Kernel, ...]:
        a = self.attention
        linears = (a.qkv, a.proj) + tuple(linear for m in self.mlps for linear in (m.fc1, m.fc2))
        attention = ((a.core.fwd,) if a.core is not None else (a.unfused.scores, a.unfused.context)
                     if a.unfused is not None else (a.ring.causal.fwd, a.ring.half.fwd))
        rope = (a.rope.fwd,) if a.rope is not None else ()
        return (*(k for linear in linears for k in linear.direct()), *attention, self.norm.fwd,
                self.residual_add, a.output_copy, *rope, *(m.activation.fwd for m in self.mlps))


@lru_cache(maxsize=256)
def layer_ops(sh: Shapes) -> LayerOps:
    """The layer's kernels at these shapes (cached: a layout search meets a few dozen shapes thousands of times)."""
    return LayerOps(norm=passes(sh.norm, tokens=sh.norm_tokens, hidden=sh.hidden), attention=self_attention_ops(sh),
                    residual_add=kernel("residual_add", numel=sh.norm_tokens * sh.hidden),
                    mlp=mlp_ops(sh) if sh.moe is None else None,
                    moe=moe_ops(sh.moe, sh.hidden) if sh.moe is not None else None)
