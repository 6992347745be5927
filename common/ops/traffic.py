"""The bytes a kernel moves: the least it must read and write once, its inputs and outputs at their dtypes (a = the
compute dtype's bytes, g = the main grads'), by name and dims, so that a compute record read back gets them as the
catalogue's entry does. A kernel that makes several passes, upcasts to fp32 or scatters moves more: the hardware
model's fitted efficiencies absorb that (ledger/models/simulate/kernel_cost.py).

GEMMs count their output (fprop and dgrad write m x n in the compute dtype; wgrad accumulates into the grad-dtype
main_grad, reading and writing m x n) and, apart, their two operands read once, m x k and k x n: what bounds a GEMM
whose reduction is short against the operand it streams (unfused attention's P V reads the [s, s] probabilities at
k = s for n = head dim), where its FLOPs do not (ledger/models/simulate/kernel_cost.py).
The per-element work (rank.RATE_OPS): `optimizer.step` is one element's update: the grad copied into the fp32 main
grad when the grads are 16-bit, its norm (read), its clip (read, write), fused AdamW (grad read; main param,
exp_avg, exp_avg_sq read and written) and the 16-bit model param written from the main param; `grad_buffer.zero`
writes one grad-dtype element.
"""
from __future__ import annotations

from typing import Mapping

from common.ops.kernel import Kernel
from common.ops.linear import MAIN_GRAD_ADD
from common.ops.megatron import OPTIMIZER_STEP_FOREACH
from common.ops.rank import OPTIMIZER_STEP, into_main_grad
from common.ops.sizes import DTYPE_BYTES

FP32 = 4


def gemm_output_bytes(m: int, n: int, wgrad: bool, dtype_bytes: int, grad_bytes: int) -> float:
    return m * n * (2 * grad_bytes if wgrad else dtype_bytes)


def gemm_operand_bytes(m: int, n: int, k: int, operand_bytes: int) -> float:
    return (m * k + k * n) * operand_bytes


def cost_name(name: str, dims: Mapping[str, int]) -> str:
    """The name a memory-bound kernel is priced under (its fitted efficiency): the router's top-k with the
    load-balancing loss as `router.topk_aux` (a longer chain: the softmax over all experts, the loss's sums, ~20 us
    more on an H200 at any token count); Megatron-LM's masked softmax in fp32 (--attention-softmax-in-fp32) as
    `core_attention.softmax_fp32` (vectorised casts and fp32 kernels, where the 16-bit chain's in-place masked_fill_
    broadcasts the mask: a different kernel mix per byte); any other kernel under its own name."""
    for chain, variant, dim in (("router.topk.", "router.topk_aux.", "aux_loss"),
                                ("core_attention.softmax.", "core_attention.softmax_fp32.", "fp32")):
        if name.startswith(chain) and dims.get(dim):
            return variant + name[len(chain):]
    return name


def bytes_moved(kernel: Kernel, dtype_bytes: int, grad_bytes: int) -> float:
    """The bytes a kernel other than a GEMM or core attention moves (module docstring); LookupError for a name this
    table lacks."""
    d, a, name = dict(kernel.dims), dtype_bytes, kernel.name
    if name in ("rms_norm.fwd", "layer_norm.fwd"):  # read x, write y
        return 2 * a * d["tokens"] * d["hidden"]
    if name in ("rms_norm.bwd", "layer_norm.bwd"):  # read x and dy, write dx
        return 3 * a * d["tokens"] * d["hidden"]
    if name == "residual_add":  # read two, write one
        return 3 * a * d["numel"]
    if name == "attention_output.copy":  # [b, heads, s, d] -> [s, b, heads d]
        return 2 * a * d["numel"]
    if name in ("rope.fwd", "rope.bwd"):  # the fused QKV in, q k v out (and back)
        return 2 * a * d["seq"] * d["batch"] * d["groups"] * d["width"] * d["head_dim"]
    if name == "swiglu.fwd":  # read [t, 2f], write [t, f]
        return 1.5 * a * d["tokens"] * d["width"]
    if name == "swiglu.bwd":  # read [t, 2f] and dy [t, f], write dx [t, 2f]
        return 2.5 * a * d["tokens"] * d["width"]
    if name == "gelu.fwd":  # read [t, f], write [t, f]
        return 2 * a * d["tokens"] * d["width"]
    if name == "gelu.bwd":  # read x and dy, write dx
        return 3 * a * d["tokens"] * d["width"]
    if name == "embedding.fwd":  # gather t rows, write them
        return 2 * a * d["tokens"] * d["hidden"]
    if name == "embedding.bwd" and into_main_grad(kernel):  # t rows read, cast to main_grad's dtype, read again
        return (a + 4 * grad_bytes) * d["tokens"] * d["hidden"]  # and added into theirs (read and written)
    if name == "embedding.bwd":  # a dense [V, h] grad zeroed and scattered into, then added into main_grad
        return d["vocab"] * d["hidden"] * (2 * a + 2 * grad_bytes) + 3 * a * d["tokens"] * d["hidden"]
    if name == "cross_entropy.fwd":  # read the logits
        return a * d["tokens"] * d["vocab"]
    if name == "cross_entropy.bwd":  # read the logits (softmax), write their grad
        return 2 * a * d["tokens"] * d["vocab"]
    if name == "router.topk.fwd":  # read the logits (twice with the loss's softmax over all E), write k ids, probs
        return a * d["tokens"] * d["experts"] * (1 + d["aux_loss"]) + (8 + FP32) * d["tokens"] * d["topk"]
    if name == "router.topk.bwd":  # read the k probs' grads (and the logits with the loss), write the logits' grad
        return a * d["tokens"] * d["experts"] * (1 + d["aux_loss"]) + FP32 * d["tokens"] * d["topk"]
    if name == "moe.delayed_wgrad.cat":  # read the held pieces, write them contiguous
        return 2 * a * d["rows"] * d["width"]
    if name == "moe.permute.fwd":  # gather the R routed rows
        return 2 * a * d["rows"] * d["hidden"]
    if name == "moe.permute.bwd":  # read the R rows' grads, write the tokens' [T, h] grad
        return a * (d["rows"] + d["tokens"]) * d["hidden"]
    if name == "moe.unpermute.fwd":  # read the R expert rows, write the tokens' weighted sums
        return a * (d["rows"] + d["tokens"]) * d["hidden"]
    if name == "moe.unpermute.bwd":  # read the output grad and the rows (the probabilities' grad), write the rows'
        return a * (d["tokens"] + 2 * d["rows"]) * d["hidden"]
    if name == "ring_attention.merge.fwd":  # C - 1 merges over L/2 rows: the fp32 out read and written, a block read
        return (d["cp"] - 1) * d["batch"] * d["heads"] * d["seq"] // 2 * d["head_dim"] * (2 * FP32 + a)
    if name == "ring_attention.merge.bwd":  # per step dK/dV zeroed, filled and cast; dQ's rows accumulated in fp32
        kv_block = 2 * d["batch"] * d["kv_heads"] * d["seq"] * d["head_dim"]
        dq_rows = d["batch"] * d["heads"] * d["head_dim"] * ((d["cp"] - 1) * d["seq"] // 2 + d["seq"])
        return d["cp"] * kv_block * (3 * FP32 + a) + 3 * FP32 * dq_rows
    megatron = megatron_bytes(kernel, a)
    if megatron is not None:
        return megatron
    raise LookupError(f"no bytes-moved estimate for {kernel.describe()} (common/ops/traffic.py)")


def megatron_bytes(kernel: Kernel, a: int) -> float | None:
    """Megatron-LM's unfused chains (common/ops/megatron.py), each kernel of the chain reading and writing its
    tensors once; docs/formulas.md, "Megatron-LM's kernels"."""
    d, name = dict(kernel.dims), kernel.name
    if name == "core_attention.softmax.fwd":  # masked_fill_ (scores r/w, mask r), softmax r/w; fp32: + 2 casts
        return d["elements"] * ((2 * a + 21) if d["fp32"] else (4 * a + 1))
    if name == "core_attention.softmax.bwd":  # softmax bwd r 2 w 1; AsStrided zeros + copy; CopySlices copy, clone,
        return d["elements"] * ((2 * a + 37) if d["fp32"] else (14 * a + 1))  # masked_fill, copy back
    if name == "core_attention.softmax_fused.fwd":  # one kernel: the scores read, the probabilities written
        return d["elements"] * 2 * a
    if name == "core_attention.softmax_fused.bwd":  # the probabilities and their gradient read, one gradient written
        return d["elements"] * 3 * a
    if name in ("attention.repeat_kv.fwd", "attention.repeat_kv.bwd"):  # K and V: kv read, query-wide written
        return 2 * a * d["tokens"] * (d["kv"] + d["query"])
    if name in ("rope_unfused.fwd", "rope_unfused.bwd"):  # q's copy; 6 elementwise passes on q and on k
        return a * d["tokens"] * (2 * d["query"] + 12 * (d["query"] + d["kv"]))
    if name == "swiglu_unfused.fwd":  # silu, up + offset, product: r 4f w 3f over the f-wide halves
        return 3.5 * a * d["tokens"] * d["width"]
    if name == "swiglu_unfused.bwd":  # the product's two grads, silu's, their concatenation: r 8f w 5f
        return 6.5 * a * d["tokens"] * d["width"]
    if name == "cross_entropy_fp32.fwd":  # 16-bit logits to fp32, max, sub, exp, sum, div: r 2 + 20, w 16
        return (a + 4 + 4 + 8 + 8 + 4 + 8) * d["tokens"] * d["vocab"]
    if name == "cross_entropy_fp32.bwd":  # the fp32 grad scaled in place, cast to 16 bits
        return (8 + FP32 + a) * d["tokens"] * d["vocab"]
    if name == MAIN_GRAD_ADD:  # 16-bit wgrad read, fp32 main_grad read and written
        return (a + 2 * FP32) * d["numel"]
    return None


def bytes_per_element(rate: str, params_dtype: str, grad_dtype: str) -> float:
    """What one element of a per-element op moves (module docstring): the optimizer's per main param, the grad
    buffer's zeroing per grad element."""
    g, a = DTYPE_BYTES[grad_dtype], DTYPE_BYTES[params_dtype]
    if rate == OPTIMIZER_STEP_FOREACH:  # decay, lerp, mul, addcmul, sqrt, div, add, addcdiv; clip; copy-out
        return 80 + 3 * FP32 + FP32 + a
    if rate != OPTIMIZER_STEP:
        return g
    copy_in = g + FP32 if g != FP32 else 0  # grads into the fp32 main grad
    norm_and_clip = FP32 + 2 * FP32
    adamw = FP32 + 3 * 2 * FP32  # grad read; main param, exp_avg, exp_avg_sq read and written
    copy_out = FP32 + a if a != FP32 else 0  # main param to the 16-bit model param
    return copy_in + norm_and_clip + adamw + copy_out
