"""One kernel's isolated time on a GPU kind, from its hardware file: what the compute sweep would have measured there.

The kernels are the catalogue's (common/ops), by name and dims, with its FLOPs and bytes moved. Three kinds:

GEMMs (`<linear>.fprop / .dgrad / .wgrad`, dims m, n, k; FLOPs 2mnk):
    seconds = fixed_s + max(flops / (peak x compute_efficiency), operand bytes / (HBM bandwidth x e_stream))
              + output bytes / (HBM bandwidth x epilogue_efficiency)
    output bytes (common/ops/traffic.py): fprop and dgrad write their m x n result in the compute dtype; wgrad
    accumulates into the grad-dtype main_grad (Megatron's gradient-accumulation fusion, as the engine and the sweep
    do): it reads and writes m x n elements of the grad dtype. Operand bytes, m x k + k x n read once, at e_stream,
    the residual add's efficiency (a plain streaming kernel's): the roofline's memory side, which binds where the
    reduction is short against a large operand (Megatron-LM's unfused attention: P V reads the [b heads s, s]
    probabilities for a head dim of n = 64, 137 GFLOP against 2.1 GB at seq 4096 micro-batch 2: 0.45 ms of reading,
    0.18 of FLOPs; the model's linears stay FLOP-bound by 2x or more).
  Fitted on the H200's sweep records (runs/bench/hardware_fit.py): the fixed term is launch, ramp and tail wave, the
  epilogue term what makes a wgrad with a short reduction (k = tokens = 1,024) run at half the efficiency of one
  with k = 8,192. efficiency(shape) = flops / (peak x seconds). Its limit, measured on the experts' grid
  (hardware_sweep.py --experts, not in the fit): a wgrad with a large output reducing over 512-1,024 rows runs
  12-27% slower than this says, and GEMMs of a few hundred rows 11-25% slower; no linear form fixes both.
  A grouped GEMM (`experts.<linear>.fprop / .dgrad`, --moe-grouped-gemm: one torch._grouped_mm over every expert's
  rows, dims m = all the rows) is the dense GEMM of its total shape times the file's `grouped_gemm.slowdown`:
  torch's grouped kernel against one dense mm of the same m, n, k, timed side by side on the device
  (runs/bench/grouped_gemm_slowdown.py); a file without the block prices it as the dense GEMM.
fp8 linears (dims fp8 = 1, --fp8-format; common/ops/linear.py): the GEMM at the file's fp8 peak with the 16-bit fit's
  fixed term and efficiency, plus its two operands' casts, memory-bound: each operand read twice (its amax, then the
  cast) and written once in one byte (5 bytes an element in bf16), at the residual add's efficiency; its output in
  16 bits, and a wgrad's then added into main_grad by DDP's hook (read the 16-bit gradient, read and write main_grad).
  Not fitted on any fp8 run: a datasheet peak and the 16-bit fits (docs/formulas.md, "FP8").
Flash attention (`core_attention.fwd / .bwd`): flops / (peak x efficiency(pass, head_dim, seq, batch x heads)).
  Under context parallelism the same for each of ring attention's blocks (common/ops/attention.py: the causal diagonal
  and the half block, dims `queries` and `causal` beside seq = s/C) at its FLOPs, with the efficiency at seq = s/C, the
  block's keys: no fit of ring blocks yet (an H200 CP sweep would give one), so the half block's shorter query side
  is priced as efficient as the diagonal. The ring's merges (`ring_attention.merge.fwd / .bwd`) are memory-bound
  kernels at the file's default efficiency.
Memory-bound kernels (everything else): fixed_s + bytes moved / (HBM bandwidth x the kernel's efficiency). Bytes
  moved is the least a kernel must read and write once (its inputs and outputs at their dtypes,
  common/ops/traffic.py `bytes_moved`), so a kernel that makes several passes, upcasts to fp32 or scatters shows as
  a lower efficiency, fitted per name (a name with no fit: its PROXY's, else the file's default). An MoE layer's
  router top-k, permute and unpermute passes (common/ops/moe.py) are each a chain of small kernels (softmax, top-k,
  counts, sorts, a read of the counts to the host): their own fixed term and efficiency, fitted on the MoE grid
  (runs/bench/hardware_sweep.py --moe), the top-k with the load-balancing loss apart (`router.topk_aux`, a longer
  chain); an expert's GEMMs are GEMMs at its row count.

Per-element rates (common/ops RATE_OPS): `optimizer.step` per main param and `grad_buffer.zero` per grad element, their
bytes per element (common/ops/traffic.py) at HBM bandwidth x their fitted efficiency.
"""
from __future__ import annotations

from common.ops import GEMM_PASSES, Kernel, bytes_moved, bytes_per_element
from common.ops.linear import runs_in_fp8
from common.ops.sizes import DTYPE_BYTES
from common.ops.traffic import cost_name, gemm_operand_bytes, gemm_output_bytes
from ledger.models.simulate.hardware import Hardware
from ledger.models.time_model.missing import CalibrationMissing

# A kernel the H200 sweep never ran (the GPT layer's) takes the efficiency of the one with its access pattern: a
# row-wise normalisation over the hidden dim, an elementwise activation (an assumption until a sweep measures them).
PROXY = {"layer_norm.fwd": "rms_norm.fwd", "layer_norm.bwd": "rms_norm.bwd", "gelu.fwd": "swiglu.fwd",
         "gelu.bwd": "swiglu.bwd",
         # Megatron's fused scale-mask-softmax (its CUDA extension, never swept here): a row-wise reduction and scale
         # over the scores, as a norm over the hidden dim
         "core_attention.softmax_fused.fwd": "rms_norm.fwd", "core_attention.softmax_fused.bwd": "rms_norm.bwd",
         # Megatron-LM's unfused chains (common/ops/megatron.py), where a file has no fit of them (the H200 and H100
         # files fit each from runs/bench/hardware_sweep.py --megatron; the H200's main_grad.add has no sweep yet):
         # torch's plain elementwise, copy and reduction kernels at the residual add's efficiency; K and V's repeat at
         # the strided output copy's; torch's foreach AdamW at the fused step's
         **dict.fromkeys(("core_attention.softmax.fwd", "core_attention.softmax.bwd", "rope_unfused.fwd",
                          "rope_unfused.bwd", "swiglu_unfused.fwd", "swiglu_unfused.bwd", "cross_entropy_fp32.fwd",
                          "cross_entropy_fp32.bwd", "main_grad.add", "core_attention.softmax_fp32.fwd",
                          "core_attention.softmax_fp32.bwd"), "residual_add"),
         "attention.repeat_kv.fwd": "attention_output.copy", "attention.repeat_kv.bwd": "attention_output.copy",
         "optimizer.step_foreach": "optimizer.step"}
ATTENTION = "core_attention"


def is_flash_attention(name: str) -> bool:
    """`core_attention.fwd / .bwd` (flash attention), not Megatron-LM's unfused `core_attention.<part>.<pass>`."""
    return name.rpartition(".")[0] == ATTENTION


STREAM_PROXY = "residual_add"  # a plain streaming elementwise kernel: what one pass over a large tensor runs at


def mainloop_seconds(hw: Hardware, flops: float, peak: float, operand_bytes: float) -> float:
    """A GEMM's main loop: its FLOPs at the fitted compute efficiency or, where that is shorter, its two operands
    streamed once at a plain streaming kernel's rate (module docstring)."""
    return max(flops / (peak * hw.gemm.compute_efficiency),
               operand_bytes / (hw.hbm_bandwidth * hw.memory.efficiency(STREAM_PROXY)))


def gemm_seconds(hw: Hardware, dtype: str, m: int, n: int, k: int, wgrad: bool, grad_bytes: int) -> float:
    g, a = hw.gemm, DTYPE_BYTES[dtype]
    out = gemm_output_bytes(m, n, wgrad, a, grad_bytes)
    return (g.fixed_s + mainloop_seconds(hw, 2.0 * m * n * k, hw.peak(dtype), gemm_operand_bytes(m, n, k, a))
            + out / (hw.hbm_bandwidth * g.epilogue_efficiency))


def fp8_gemm_seconds(hw: Hardware, dtype: str, m: int, n: int, k: int, wgrad: bool, grad_bytes: int) -> float:
    """An fp8 linear's pass (module docstring). Each pass's operands are [m, k] and [k, n]."""
    g, a = hw.gemm, DTYPE_BYTES[dtype]
    casts = (2 * a + 1) * (m * k + k * n)  # each element read twice (amax, cast) and written in one byte
    add = m * n * (a + 2 * grad_bytes) if wgrad else 0  # DDP's hook: the 16-bit gradient into main_grad
    return (g.fixed_s + mainloop_seconds(hw, 2.0 * m * n * k, hw.peak("fp8"), gemm_operand_bytes(m, n, k, 1))
            + m * n * a / (hw.hbm_bandwidth * g.epilogue_efficiency)
            + memory_seconds(hw, STREAM_PROXY, casts + add))


def attention_seconds(hw: Hardware, kernel: Kernel, dtype: str) -> float:
    d = dict(kernel.dims)
    pass_ = kernel.name.rsplit(".", 1)[1]
    return kernel.flops / (hw.peak(dtype) * hw.attention.efficiency(pass_, d["head_dim"], d["seq"],
                                                                    d["batch"] * d["heads"]))


def memory_seconds(hw: Hardware, name: str, nbytes: float) -> float:
    return hw.memory.fixed(name) + nbytes / (hw.hbm_bandwidth * hw.memory.efficiency(name, PROXY.get(name)))


def kernel_seconds(hw: Hardware, kernel: Kernel, dtype: str, grad_dtype: str) -> float:
    """Isolated seconds of one call of `kernel` in `dtype` (grads in `grad_dtype`), before the sustained factor."""
    pass_ = kernel.name.rpartition(".")[2]
    if pass_ in GEMM_PASSES:
        d = dict(kernel.dims)
        cost = fp8_gemm_seconds if runs_in_fp8(kernel) else gemm_seconds
        grouped = hw.gemm.grouped_slowdown if "experts" in d else 1.0
        return grouped * cost(hw, dtype, d["m"], d["n"], d["k"], pass_ == "wgrad", DTYPE_BYTES[grad_dtype])
    if is_flash_attention(kernel.name):
        return attention_seconds(hw, kernel, dtype)
    try:
        nbytes = bytes_moved(kernel, DTYPE_BYTES[dtype], DTYPE_BYTES[grad_dtype])
    except LookupError as e:
        raise CalibrationMissing(f"the hardware model has {e}") from None
    return memory_seconds(hw, cost_name(kernel.name, dict(kernel.dims)), nbytes)


def rate_seconds_per_element(hw: Hardware, op: str, params_dtype: str, grad_dtype: str) -> float:
    """Seconds per element of RATE_OPS: optimizer.step (per main param), grad_buffer.zero (per grad element)."""
    return bytes_per_element(op, params_dtype, grad_dtype) / (hw.hbm_bandwidth
                                                              * hw.memory.efficiency(op, PROXY.get(op)))
