"""One kernel's isolated time on a GPU kind, from its hardware file: what the compute sweep would have measured there.

The kernels are ledger/models/time_model/ops.py's, by name and dims. Three kinds:

GEMMs (`<linear>.fprop / .dgrad / .wgrad`, dims m, n, k; FLOPs 2mnk):
    seconds = fixed_s + flops / (peak x compute_efficiency) + output bytes / (HBM bandwidth x epilogue_efficiency)
    output bytes: fprop and dgrad write their m x n result in the compute dtype; wgrad accumulates into the
    grad-dtype main_grad (Megatron's gradient-accumulation fusion, as the engine and the sweep do): it reads and
    writes m x n elements of the grad dtype.
  Fitted on the H200's sweep records (runs/bench/hardware_h200.py): the fixed term is launch, ramp and tail wave, the
  epilogue term what makes a wgrad with a short reduction (k = tokens = 1,024) run at half the efficiency of one
  with k = 8,192. efficiency(shape) = flops / (peak x seconds).
Flash attention (`core_attention.fwd / .bwd`): flops / (peak x efficiency(pass, head_dim, seq, batch x heads)).
  Under context parallelism the same for each of ring attention's blocks (ops.ring_block: the causal diagonal and
  the half block, dims `queries` and `causal` beside seq = s/C) at its FLOPs, with the efficiency at seq = s/C, the
  block's keys: no fit of ring blocks yet (an H200 CP sweep would give one), so the half block's shorter query side
  is priced as efficient as the diagonal. The ring's merges (`ring_attention.merge.fwd / .bwd`) are memory-bound
  kernels at the file's default efficiency.
Memory-bound kernels (everything else): fixed_s + bytes moved / (HBM bandwidth x the kernel's efficiency). Bytes
  moved is the least a kernel must read and write once (its inputs and outputs at their dtypes, `bytes_moved`), so a
  kernel that makes several passes, upcasts to fp32 or scatters shows as a lower efficiency, fitted per name (a name
  with no fit: its PROXY's, else the file's default). An MoE layer's router top-k, permute and unpermute
  (ledger/models/time_model/ops.py) have no fit yet: the default efficiency, optimistic for kernels that sort, scatter
  and upcast (the engine's unpermute sums in fp32); an expert's GEMMs are GEMMs at its row count.

Per-element rates (ops.RATE_OPS): `optimizer.step` is the sweep's update of one element: the grad copied into the fp32
main grad when the grads are 16-bit, its norm (read), its clip (read, write), fused AdamW (grad read; main param,
exp_avg, exp_avg_sq read and written) and the 16-bit model param written from the main param;
`grad_buffer.zero` writes one grad-dtype element. Both at HBM bandwidth x their fitted efficiency.
"""
from __future__ import annotations

from ledger.models.formulas.bytes_per_param import DTYPE_BYTES
from ledger.models.simulate.hardware import Hardware
from ledger.models.time_model.missing import CalibrationMissing
from ledger.models.time_model.ops import Kernel

GEMM_PASSES = ("fprop", "dgrad", "wgrad")
# A kernel the H200 sweep never ran (the GPT layer's) takes the efficiency of the one with its access pattern: a
# row-wise normalisation over the hidden dim, an elementwise activation (an assumption until a sweep measures them).
PROXY = {"layer_norm.fwd": "rms_norm.fwd", "layer_norm.bwd": "rms_norm.bwd", "gelu.fwd": "swiglu.fwd",
         "gelu.bwd": "swiglu.bwd"}
ATTENTION = "core_attention"
FP32 = 4


def gemm_output_bytes(m: int, n: int, wgrad: bool, dtype_bytes: int, grad_bytes: int) -> float:
    return m * n * (2 * grad_bytes if wgrad else dtype_bytes)


def gemm_seconds(hw: Hardware, dtype: str, m: int, n: int, k: int, wgrad: bool, grad_bytes: int) -> float:
    g = hw.gemm
    out = gemm_output_bytes(m, n, wgrad, DTYPE_BYTES[dtype], grad_bytes)
    return (g.fixed_s + 2.0 * m * n * k / (hw.peak(dtype) * g.compute_efficiency)
            + out / (hw.hbm_bandwidth * g.epilogue_efficiency))


def attention_seconds(hw: Hardware, kernel: Kernel, dtype: str) -> float:
    d = dict(kernel.dims)
    pass_ = kernel.name.rsplit(".", 1)[1]
    return kernel.flops / (hw.peak(dtype) * hw.attention.efficiency(pass_, d["head_dim"], d["seq"],
                                                                    d["batch"] * d["heads"]))


def bytes_moved(kernel: Kernel, dtype_bytes: int, grad_bytes: int) -> float:
    """The bytes a memory-bound kernel must read and write at least once (see the module docstring)."""
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
    raise CalibrationMissing(f"the hardware model has no bytes-moved estimate for {kernel.describe()} "
                             f"(ledger/models/simulate/kernel_cost.py)")


def memory_seconds(hw: Hardware, name: str, nbytes: float) -> float:
    return hw.memory.fixed_s + nbytes / (hw.hbm_bandwidth * hw.memory.efficiency(name, PROXY.get(name)))


def kernel_seconds(hw: Hardware, kernel: Kernel, dtype: str, grad_dtype: str) -> float:
    """Isolated seconds of one call of `kernel` in `dtype` (grads in `grad_dtype`), before the sustained factor."""
    head, _, pass_ = kernel.name.rpartition(".")
    if pass_ in GEMM_PASSES:
        d = dict(kernel.dims)
        return gemm_seconds(hw, dtype, d["m"], d["n"], d["k"], pass_ == "wgrad", DTYPE_BYTES[grad_dtype])
    if head == ATTENTION:
        return attention_seconds(hw, kernel, dtype)
    return memory_seconds(hw, kernel.name, bytes_moved(kernel, DTYPE_BYTES[dtype], DTYPE_BYTES[grad_dtype]))


def optimizer_bytes_per_element(params_dtype: str, grad_dtype: str) -> float:
    g, a = DTYPE_BYTES[grad_dtype], DTYPE_BYTES[params_dtype]
    copy_in = g + FP32 if g != FP32 else 0  # grads into the fp32 main grad
    norm_and_clip = FP32 + 2 * FP32
    adamw = FP32 + 3 * 2 * FP32  # grad read; main param, exp_avg, exp_avg_sq read and written
    copy_out = FP32 + a if a != FP32 else 0  # main param to the 16-bit model param
    return copy_in + norm_and_clip + adamw + copy_out


def rate_seconds_per_element(hw: Hardware, op: str, params_dtype: str, grad_dtype: str) -> float:
    """Seconds per element of ops.RATE_OPS: optimizer.step (per main param), grad_buffer.zero (per grad element)."""
    nbytes = optimizer_bytes_per_element(params_dtype, grad_dtype) if op == "optimizer.step" \
        else DTYPE_BYTES[grad_dtype]
    return nbytes / (hw.hbm_bandwidth * hw.memory.efficiency(op))
