"""An MoE layer's kernels beside its experts' MLPs (Megatron's MoELayer, engine/transformer/moe; docs/formulas.md,
"Mixture of experts"), on the rank's T routed tokens under uniform routing:

  router        its GEMM [T, h] x [h, E] (a Linear over T rows)
  router.topk   top-k over the logits, the softmax over the k chosen and, with a load-balancing loss, over all E,
                the counts per expert, the capacity drops where configured
  moe.permute   the R kept assignments sorted by expert and their rows gathered (backward: the rows' gradients
                added back per token)
  moe.unpermute each token's probability-weighted sum over its k slots, in fp32
  experts       each local expert's MLP at its row count (one entry per distinct count), or under
                --moe-grouped-gemm one grouped MLP over all of them (`grouped`: mlp.grouped_expert_ops)
  delayed_wgrad under --moe-delay-expert-wgrad, each expert linear's one wgrad a step, over every micro-batch's
                rows (k = m x its rows; one entry per distinct count), after `moe.delayed_wgrad.cat`: the held
                operands concatenated (the output gradients [M, out] and the inputs [M, in], M = m x rows); the
                experts' backward has no wgrad then
The all-to-alls between them are collectives (the time model's), not kernels.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.ops.kernel import Kernel, OpGroup, Passes, kernel, passes
from common.ops.linear import Linear, linear
from common.ops.mlp import MLPOps, expert_ops, grouped_expert_ops
from common.ops.shapes import ExpertShapes

DELAYED_CAT = "moe.delayed_wgrad.cat"  # a weight's held operands made contiguous for its one wgrad
# each pass a chain of small kernels (sorts, counts); router.topk_aux: the top-k with the load-balancing loss
ROUTING = ("router.topk", "router.topk_aux", "moe.permute", "moe.unpermute")


def is_routing_kernel(name: str) -> bool:
    """An MoE layer's router top-k, permute or unpermute pass: several kernels, so a fixed cost of its own beside the
    bytes it moves (ledger/models/simulate/kernel_cost.py)."""
    return name.rpartition(".")[0] in ROUTING


@dataclass(frozen=True)
class DelayedWgradOps(OpGroup):
    """One expert's flush (engine/tensor_parallel/layers.py flush_delayed_weight_grads): per linear, its held
    operands concatenated, then its wgrad over all of them."""
    fc2_operands: Kernel
    fc2: Kernel
    fc1_operands: Kernel
    fc1: Kernel


@dataclass(frozen=True)
class MoEOps(OpGroup):
    router: Linear
    topk: Passes
    permute: Passes
    unpermute: Passes
    experts: tuple[tuple[int, MLPOps], ...]  # (rows, that expert's MLP) at ExpertShapes.row_counts; () if grouped
    grouped: MLPOps | None = None  # --moe-grouped-gemm: the experts' grouped GEMMs and one SwiGLU
    # --moe-delay-expert-wgrad: (rows a micro-batch, its fc1's and fc2's flush over every micro-batch's rows)
    delayed_wgrad: tuple[tuple[int, DelayedWgradOps], ...] = ()

    def expert(self, rows: int) -> MLPOps:
        return dict(self.experts)[rows]

    def delayed(self, rows: int) -> DelayedWgradOps:
        """The flush of an expert with `rows` rows a micro-batch, under --moe-delay-expert-wgrad."""
        return dict(self.delayed_wgrad)[rows]

    @property
    def mlps(self) -> tuple[MLPOps, ...]:
        """The MLPs the layer runs: the grouped one, or one per expert row count."""
        return (self.grouped,) if self.grouped is not None else tuple(m for _, m in self.experts)


def moe_ops(x: ExpertShapes, h: int) -> MoEOps:
    copies = dict(tokens=x.tokens, topk=x.topk, rows=x.routed, hidden=h)
    return MoEOps(router=linear("router", x.tokens, x.experts, h),
                  topk=passes("router.topk", tokens=x.tokens, experts=x.experts, topk=x.topk, aux_loss=x.aux_loss,
                              dropping=x.dropping),
                  permute=passes("moe.permute", **copies), unpermute=passes("moe.unpermute", **copies),
                  experts=() if x.grouped else tuple((rows, expert_ops(x, h, rows)) for rows in x.row_counts),
                  grouped=grouped_expert_ops(x, h) if x.grouped else None,
                  delayed_wgrad=tuple((rows, _wgrads(x, h, total))
                                      for rows, total in zip(x.row_counts, x.delayed_wgrad_rows)))


def _wgrads(x: ExpertShapes, h: int, rows: int) -> DelayedWgradOps:
    """An expert's flush over `rows` rows (every micro-batch's): fc2's output gradients [rows, h] and inputs [rows, f],
    fc1's [rows, 2f] and [rows, h], each pair concatenated from the m micro-batches' pieces, then each wgrad."""
    mlp, m = expert_ops(x, h, rows), x.delayed_wgrad_microbatches
    return DelayedWgradOps(fc2_operands=kernel(DELAYED_CAT, rows=rows, width=h + x.ffn, pieces=m), fc2=mlp.fc2.wgrad,
                           fc1_operands=kernel(DELAYED_CAT, rows=rows, width=x.fc1 + h, pieces=m), fc1=mlp.fc1.wgrad)
