"""The efficiency curves of a hardware file fitted from compute-sweep records (`compute` events, probes/
compute_sweep/), and from nothing else: no step time enters, so a step-time check of the file against the runs the
records came from is a prediction, not a replay. runs/bench/hardware_fit.py runs it on the committed H200 grid sweeps
and writes ledger/models/hardware/h200.json's fitted blocks; tests hold the file equal to this fit.

Each block is the cost form of ledger/models/simulate/kernel_cost.py, fitted by least squares on relative error (a point
weighs 1/t^2, as ledger/models/time_model/comm.py fits links):
  gemm            t = fixed_s + max(flops / (peak e_c), operand bytes / (HBM bw e_stream)) + output bytes /
                  (HBM bw e_epilogue), e_stream the memory fit's residual add; over every GEMM record whose FLOPs
                  bound it
  attention       efficiency = flops / (peak t) per (pass, head_dim, seq) measured, as a curve over batch x heads
                  (the median of the records at one point)
  memory_bound    t = fixed_s + bytes moved / (HBM bw e_name): one shared fixed_s, one efficiency per kernel name;
                  an MoE routing pass (router top-k, permute, unpermute: chains of small kernels) has a fixed_s of
                  its own; the default (a kernel with no record) is the plain kernels' median; the two rates:
                  bytes / (HBM bw t)
  sustained       the sweep's sustained.layer records: slowdown t / (compute-bound t + memory-bound t) against the
                  layer's isolated efficiency (FLOPs / (peak x compute-bound t)), a line through them
Several records of one kernel (several runs, several ranks) give their median; cached copies count once.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from statistics import median
from typing import Any, Callable, Iterable

from common.ops import (
    GEMM_PASSES,
    PER_ELEMENT,
    SUSTAINED,
    bytes_moved,
    bytes_per_element,
    kernel,
)
from common.ops.megatron import megatron_only
from common.ops.moe import is_routing_kernel
from common.ops.sizes import DTYPE_BYTES
from common.ops.traffic import cost_name, gemm_operand_bytes, gemm_output_bytes
from ledger.models.simulate.kernel_cost import STREAM_PROXY, is_flash_attention

Point = tuple[str, dict[str, int], float, float]  # op, dims, flops, seconds


def solve_weighted(rows: list[list[float]], targets: list[float]) -> list[float]:
    """Least squares on relative error: minimise sum ((row . x - t) / t)^2 (normal equations, Gauss-Jordan)."""
    n = len(rows[0])
    a = [[0.0] * n for _ in range(n)]
    b = [0.0] * n
    for row, t in zip(rows, targets):
        w = 1.0 / t ** 2
        for i in range(n):
            b[i] += w * row[i] * t
            for j in range(n):
                a[i][j] += w * row[i] * row[j]
    for col in range(n):
        pivot = max(range(col, n), key=lambda r: abs(a[r][col]))
        a[col], a[pivot], b[col], b[pivot] = a[pivot], a[col], b[pivot], b[col]
        if a[col][col] == 0:
            raise ValueError("the fit is underdetermined: too few distinct records")
        for r in range(n):
            if r != col:
                f = a[r][col] / a[col][col]
                a[r] = [x - f * y for x, y in zip(a[r], a[col])]
                b[r] -= f * b[col]
    return [b[i] / a[i][i] for i in range(n)]


def distinct(records: Iterable[dict[str, Any]]) -> tuple[list[Point], list[dict[str, Any]], str]:
    """(median per kernel, distinct sustained.layer records, the grad dtype) of `compute` records."""
    seconds: dict[tuple, list[float]] = defaultdict(list)
    flops: dict[tuple, float] = {}
    sustained: dict[tuple, dict[str, Any]] = {}
    grad_dtype = "fp32"
    for r in records:
        if r["op"] == SUSTAINED:
            sustained[(r["seconds"], r["compute_bound_s"], r["memory_bound_s"])] = r
            continue
        if r["op"] == "grad_buffer.zero":
            grad_dtype = r["dtype"]
        key = (r["op"], tuple(sorted(r["dims"].items())), r["dtype"])
        seconds[key].append(float(r["seconds"]))
        flops[key] = float(r.get("flops") or 0.0)
    points = [(op, dict(dims), flops[(op, dims, dt)], median(v)) for (op, dims, dt), v in sorted(seconds.items())]
    return points, list(sustained.values()), grad_dtype


@dataclass(frozen=True)
class HardwareFit:
    gemm: dict[str, float]  # fixed_s, compute_efficiency, epilogue_efficiency
    attention: dict[str, dict[int, dict[int, list[list[float]]]]]  # pass -> head_dim -> seq -> [[b x heads, eff]]
    attention_measured: dict[str, dict[int, list[int]]]  # pass -> head_dim -> the seqs measured
    memory: dict[str, Any]  # fixed_s, default_efficiency, efficiency_by_kernel[, fixed_s_by_kernel]
    sustained: dict[str, float]  # threshold_efficiency, slope
    residuals: list[tuple[str, str, float, float]]  # kind, kernel, measured s, fitted s
    counts: dict[str, int]


def _is_gemm(op: str) -> bool:
    return op.rpartition(".")[2] in GEMM_PASSES


def fit_gemm(points: list[Point], peak: float, bw: float, dtype_bytes: int, grad_bytes: int,
             stream_efficiency: float):
    """The three GEMM terms; a record whose operands' streaming (at `stream_efficiency`, kernel_cost.mainloop_seconds)
    outlasts its FLOPs at the first fit's efficiency says nothing of that efficiency: the fit is redone without it."""
    gemms = [p for p in points if _is_gemm(p[0])]
    rows = [[1.0, f / peak, gemm_output_bytes(d["m"], d["n"], op.endswith("wgrad"), dtype_bytes, grad_bytes) / bw]
            for op, d, f, _ in gemms]
    floors = [gemm_operand_bytes(d["m"], d["n"], d["k"], dtype_bytes) / (bw * stream_efficiency)
              for _, d, _, _ in gemms]
    targets = [t for *_, t in gemms]
    fixed, inv_c, inv_e = solve_weighted(rows, targets)
    flop_bound = [i for i, (r, floor) in enumerate(zip(rows, floors)) if r[1] * inv_c >= floor]
    if len(flop_bound) < len(rows):
        fixed, inv_c, inv_e = solve_weighted([rows[i] for i in flop_bound], [targets[i] for i in flop_bound])
    fitted = [fixed + max(r[1] * inv_c, floor) + r[2] * inv_e for r, floor in zip(rows, floors)]
    block = {"fixed_s": fixed, "compute_efficiency": 1 / inv_c, "epilogue_efficiency": 1 / inv_e}
    residuals = [("gemm", _describe(op, d), t, p) for (op, d, _, t), p in zip(gemms, fitted)]
    return block, residuals, len(rows) - len(flop_bound)


def fit_attention(points: list[Point], peak: float):
    """Per pass, head dim and seq: efficiency = flops / (peak t) by batch x heads (the median of the records at one
    point: several models share a head count)."""
    samples: dict[tuple[str, int, int, int], list[float]] = defaultdict(list)
    for op, d, f, t in points:
        if is_flash_attention(op):
            samples[(op.rpartition(".")[2], d["head_dim"], d["seq"], d["batch"] * d["heads"])].append(f / (peak * t))
    curves: dict[str, dict[int, dict[int, list[list[float]]]]] = {}
    for (pass_, dim, seq, bh), effs in sorted(samples.items()):
        curves.setdefault(pass_, {}).setdefault(dim, {}).setdefault(seq, []).append([bh, median(effs)])
    measured = {p: {dim: sorted(by_seq) for dim, by_seq in by_dim.items()} for p, by_dim in curves.items()}
    return curves, measured


def fit_memory(points: list[Point], bw: float, dtype_bytes: int, grad_bytes: int, params_dtype: str,
               grad_dtype: str):
    bound = [p for p in points if not _is_gemm(p[0]) and not is_flash_attention(p[0]) and p[0] not in PER_ELEMENT]
    chains = [p for p in bound if is_routing_kernel(p[0])]
    bound = [p for p in bound if not is_routing_kernel(p[0])]
    keys = [cost_name(op, d) for op, d, _, _ in bound]
    names = sorted(set(keys))
    nbytes = [bytes_moved(kernel(op, **d), dtype_bytes, grad_bytes) for op, d, _, _ in bound]
    rows = [[1.0] + [b / bw if key == name else 0.0 for name in names] for key, b in zip(keys, nbytes)]
    x = solve_weighted(rows, [t for *_, t in bound])
    if x[0] < 0:  # no fixed cost resolved: through the origin
        x = [0.0] + solve_weighted([r[1:] for r in rows], [t for *_, t in bound])
    by_kernel = {name: 1 / inv for name, inv in zip(names, x[1:])}
    residuals = [("memory", _describe(op, d), t, sum(a * b for a, b in zip(r, x)))
                 for (op, d, _, t), r in zip(bound, rows)]
    for op, d, _, t in points:
        if op in PER_ELEMENT:
            by_kernel[op] = bytes_per_element(op, params_dtype, grad_dtype) * d["numel"] / (bw * t)
    # the default prices an engine kernel no sweep timed: Megatron-LM's slower unfused chains stay out of it
    engine = {key for key, (op, *_) in zip(keys, bound) if not megatron_only(op)}
    block = {"fixed_s": x[0], "default_efficiency": median(by_kernel[n] for n in names if n in engine),
             "efficiency_by_kernel": by_kernel}
    fixed_by_kernel = {}
    for name in sorted({cost_name(op, d) for op, d, *_ in chains}):
        own = [(d, t, bytes_moved(kernel(op, **d), dtype_bytes, grad_bytes) / bw) for op, d, _, t in chains
               if cost_name(op, d) == name]
        fixed_by_kernel[name], by_kernel[name] = fit_routing_pass([(s, t) for _, t, s in own])
        residuals += [("memory", _describe(name, d), t, fixed_by_kernel[name] + s / by_kernel[name])
                      for d, t, s in own]
    if fixed_by_kernel:
        block["fixed_s_by_kernel"] = fixed_by_kernel
    return block, residuals


def fit_routing_pass(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(fixed seconds, efficiency) of one MoE routing pass from its (seconds at full HBM bandwidth, measured seconds)
    points, least squares on relative error within fixed >= 0 and efficiency <= 1: a pass whose time barely grows
    with its bytes (the permute waits for the counts' read) is a fixed cost at full bandwidth."""
    if len({s for s, _ in points}) > 1:
        fixed, inv = solve_weighted([[1.0, s] for s, _ in points], [t for _, t in points])
        if fixed >= 0 and inv >= 1:
            return fixed, 1 / inv
        if fixed < 0:
            (inv,) = solve_weighted([[s] for s, _ in points], [t for _, t in points])
            if inv >= 1:
                return 0.0, 1 / inv
    (fixed,) = solve_weighted([[1.0] for _ in points], [t - s for s, t in points])
    return max(fixed, 0.0), 1.0


def factor_minimising(loss: Callable[[float], float], low: float = 0.25, high: float = 4.0) -> float:
    """The positive factor in [low, high] that minimises `loss` (one minimum there): golden-section search on its log,
    40 steps. What a host context is fitted by (runs/bench/host_model.py, host_contexts.py)."""
    lo, hi, golden = math.log(low), math.log(high), (math.sqrt(5) - 1) / 2
    for _ in range(40):
        a, b = hi - golden * (hi - lo), lo + golden * (hi - lo)
        lo, hi = (lo, b) if loss(math.exp(a)) < loss(math.exp(b)) else (a, hi)
    return math.exp((lo + hi) / 2)


def slowdown_line(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(x where y = 1, slope) of the least-squares line through (x, slowdown) points with at least two distinct x:
    where a power-limit slowdown starts, and how fast it grows."""
    mx, my = sum(x for x, _ in points) / len(points), sum(y for _, y in points) / len(points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    return mx - (my - 1) / slope, slope


def fit_sustained(records: list[dict[str, Any]], peak: float) -> dict[str, float]:
    pts = [(float(r["flops"]) / (peak * float(r["compute_bound_s"])),
            float(r["seconds"]) / (float(r["compute_bound_s"]) + float(r["memory_bound_s"]))) for r in records]
    if len({x for x, _ in pts}) < 2:
        raise ValueError("the sustained fit needs sustained.layer records of at least two layers")
    threshold, slope = slowdown_line(pts)
    return {"threshold_efficiency": threshold, "slope": slope}


def _describe(op: str, dims: dict[str, int]) -> str:
    return kernel(op, **dims).describe()


def fit_hardware(records: Iterable[dict[str, Any]], peak: float, hbm_bandwidth: float,
                 dtype: str = "bf16") -> HardwareFit:
    """The fitted blocks of a hardware file from `compute` records of one device kind, in `dtype`."""
    points, sustained, grad_dtype = distinct(r for r in records if r["dtype"] in (dtype, "fp32"))
    a, g = DTYPE_BYTES[dtype], DTYPE_BYTES[grad_dtype]
    memory, memory_res = fit_memory(points, hbm_bandwidth, a, g, dtype, grad_dtype)
    stream = memory["efficiency_by_kernel"].get(STREAM_PROXY, memory["default_efficiency"])
    gemm, gemm_res, streamed = fit_gemm(points, peak, hbm_bandwidth, a, g, stream)
    attention, measured = fit_attention(points, peak)
    counts = {"gemm": sum(_is_gemm(p[0]) for p in points), "gemm_streamed": streamed,
              "attention": sum(is_flash_attention(p[0]) for p in points),
              "memory_bound": len(memory_res), "sustained": len(sustained)}
    return HardwareFit(gemm=gemm, attention=attention, attention_measured=measured, memory=memory,
                       sustained=fit_sustained(sustained, peak), residuals=gemm_res + memory_res, counts=counts)
