"""The kernels where Megatron-LM's own layers (--transformer-impl local, Megatron's unfused paths) differ from this
engine's: each unfused chain of torch kernels is one catalogue entry, named after what it computes, priced by the
bytes its kernels move together (traffic.py) or, for the batched matrix products, as the GEMM it is.

  core attention, unfused (DotProductAttention on [b, heads, s, s], E = b heads s^2 elements):
    core_attention.scores.fprop       baddbmm Q K^T: m = b heads s, n = s, k = d
    core_attention.softmax.fwd        masked_fill_ of the mask, softmax (with --attention-softmax-in-fp32 the fp32
                                      copy it works on and the 16-bit copy after)
    core_attention.softmax_fused.fwd  instead, where Megatron's fused scale-mask-softmax kernel runs (--masked-softmax-
                                      fusion and a shape it takes, common/ops/sizes.py fused_softmax): one kernel,
                                      the scores read and the probabilities written once (bwd: the probabilities and
                                      their gradient read, the scores' gradient written)
    core_attention.context.fprop      bmm P V: m = b heads s, n = d, k = s
    backward: core_attention.context.dgrad (dP = dO V^T: m = b heads s, n = s, k = d), core_attention.value.dgrad
    (dV = P^T dO: m = b heads s, n = d, k = s), core_attention.softmax.bwd (softmax's backward and masked_fill_'s:
    through AsStrided and CopySlices, the in-place op on a view of the scores), core_attention.scores.dgrad twice
    (dQ and dK: m = b heads s, n = d, k = s)
  attention.repeat_kv               K and V repeated to every head (fwd: two copies; bwd: two sums over repeats)
  rope_unfused                      Megatron's _apply_rotary_pos_emb_bshd on q and k (cos and sin products,
                                    rotate_half's neg and cat, the add, the concatenation), and q's reshape copy
  swiglu_unfused                    chunk, silu, the up half + glu_linear_offset, the product (bwd: the product's two
                                    gradients, silu's, their concatenation)
  cross_entropy_fp32                Megatron's vocab_parallel_cross_entropy: the fp32 copy of the logits, max, sub,
                                    exp, sum, div in place (bwd: the in-place gradient, scaled, cast to 16 bits)
  main_grad.add                     without gradient-accumulation fusion: a linear's 16-bit weight gradient added
                                    into its fp32 main_grad by DDP's hook (linear.py; this engine's runs too)
  optimizer.step_foreach            torch's foreach AdamW per main param, with Megatron's clip and copy-out
docs/formulas.md, "Megatron-LM's kernels", counts each one's bytes.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.ops.kernel import Kernel, OpGroup, Passes, passes
from common.ops.linear import MAIN_GRAD_ADD, gemm
from common.ops.shapes import Shapes

OPTIMIZER_STEP_FOREACH = "optimizer.step_foreach"
# The memory-bound chains only Megatron-LM's layers run (each with a .fwd and a .bwd entry)
CHAINS = ("core_attention.softmax", "core_attention.softmax_fused", "attention.repeat_kv", "rope_unfused",
          "swiglu_unfused", "cross_entropy_fp32")


def megatron_only(name: str) -> bool:
    """An entry this engine never runs: one of Megatron-LM's unfused chains, its main_grad add or foreach AdamW."""
    return name in (MAIN_GRAD_ADD, OPTIMIZER_STEP_FOREACH) or name.rpartition(".")[0] in CHAINS


@dataclass(frozen=True)
class UnfusedAttentionOps(OpGroup):
    scores: Kernel  # Q K^T
    softmax: Passes
    context: Kernel  # P V
    context_grad: Kernel  # dP
    value_grad: Kernel  # dV
    scores_grad: Kernel  # dQ, dK (each)


def unfused_attention(sh: Shapes) -> UnfusedAttentionOps:
    rows = sh.micro_batch * sh.heads * sh.seq
    return UnfusedAttentionOps(
        scores=gemm("core_attention.scores.fprop", rows, sh.seq, sh.head_dim),
        softmax=(passes("core_attention.softmax_fused", elements=rows * sh.seq) if sh.megatron.fused_softmax else
                 passes("core_attention.softmax", elements=rows * sh.seq, fp32=int(sh.megatron.softmax_fp32))),
        context=gemm("core_attention.context.fprop", rows, sh.head_dim, sh.seq),
        context_grad=gemm("core_attention.context.dgrad", rows, sh.seq, sh.head_dim),
        value_grad=gemm("core_attention.value.dgrad", rows, sh.head_dim, sh.seq),
        scores_grad=gemm("core_attention.scores.dgrad", rows, sh.head_dim, sh.seq))


def repeat_kv(sh: Shapes) -> Passes:
    return passes("attention.repeat_kv", tokens=sh.tokens, query=sh.query, kv=sh.kv_heads * sh.head_dim)


def unfused_rope(sh: Shapes) -> Passes:
    return passes("rope_unfused", tokens=sh.tokens, query=sh.query, kv=sh.kv_heads * sh.head_dim)


def unfused_swiglu(sh: Shapes, rows: int, width: int) -> Passes:
    return passes("swiglu_unfused", tokens=rows, width=width)


def fp32_cross_entropy(sh: Shapes) -> Passes:
    return passes("cross_entropy_fp32", tokens=sh.tokens, vocab=sh.vocab)

