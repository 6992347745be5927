"""The time model's Calibration built from a hardware file instead of a run's sweeps: what `simulate` and `search`
price a layout with, through the unchanged ledger.models.time_model.predict_step.

    cal = hardware_calibration(cfg, load_hardware("H200"))
    predict_step(cfg, cal)

Every kernel of every pipeline stage of cfg (ledger.models.time_model.ops.kernels) gets its isolated seconds from
kernel_cost.py; the per-element rates of the optimizer step and the grad-buffer memset likewise; `power` is the
hardware's slowdown at its power limit for this model's layer (over the isolated efficiency of one decoder layer's
GEMMs and core attention forward, the kernels the sweep's sustained.layer record runs back to back), which
predict_step scales to the step's own compute-bound share; the CommModel
prices every group kind by its span over nodes (topology.py); the file's `host` block, where it has one, prices the
host timeline (ledger/models/time_model/host.py), else the step is the device's alone and a note says so.

Fast by memoisation: a kernel's seconds depend only on (hardware, kernel, dtypes), the kernel set of a layout only on
its TP-local shapes (stage_kernels), and a search over thousands of layouts of one model meets the same few hundred
kernels again and again.
"""
from __future__ import annotations

from functools import lru_cache

from common.config import RunConfig
from common.ops import Kernel, Shapes, layer_ops
from common.ops.linear import runs_in_fp8
from common.ops.rank import optimizer_rate
from ledger.models.simulate.hardware import Hardware
from ledger.models.simulate.kernel_cost import kernel_seconds, rate_seconds_per_element
from ledger.models.simulate.topology import comm_model
from ledger.models.time_model.calibration import Calibration, KernelKey, PowerLimit
from ledger.models.time_model.host_recipe import unmodelled_host, unpriced_host
from ledger.models.time_model.ops import kernels

_KERNEL_SETS: dict[Shapes, frozenset[Kernel]] = {}


@lru_cache(maxsize=1 << 16)
def _seconds(hw: Hardware, kernel: Kernel, dtype: str, grad_dtype: str) -> float:
    return kernel_seconds(hw, kernel, dtype, grad_dtype)


def stage_kernels(cfg: RunConfig) -> frozenset[Kernel]:
    """Every distinct kernel of every pipeline stage of cfg (ops.kernels of each pp rank). The set depends on the
    TP-local shapes only (the first stage adds the embedding's, the last the head's, every stage the same layer
    kernels; recompute re-runs kernels already in it), so it is computed once per Shapes: a search meets a few
    dozen shapes over thousands of layouts, and building an 80-layer model's passes costs tens of ms."""
    shapes = Shapes.of(cfg)
    found = _KERNEL_SETS.get(shapes)
    if found is None:
        found = frozenset().union(*(kernels(cfg, r) for r in range(cfg.parallel.pipeline_model_parallel_size)))
        _KERNEL_SETS[shapes] = found
    return found


def layer_efficiency(hw: Hardware, cfg: RunConfig, found: dict[KernelKey, float], dtype: str) -> float:
    """Isolated efficiency of one decoder layer's compute-bound kernels (those of the sweep's sustained.layer record
    that count FLOPs): their FLOPs, each over the peak of the precision it runs in (an fp8 linear's the fp8 peak),
    over their seconds."""
    layer = [k for k in layer_ops(Shapes.of(cfg)).sustained() if k.flops > 0]
    seconds = sum(found[(k.name, k.dims, dtype)] for k in layer)
    at_peak = sum(k.flops / hw.peak("fp8" if runs_in_fp8(k) else dtype) for k in layer)
    return at_peak / seconds if seconds > 0 else 0.0


def power_limit(hw: Hardware, cfg: RunConfig, found: dict[KernelKey, float], dtype: str) -> PowerLimit:
    """The layer's full-load slowdown (the file's line over its isolated efficiency) and the share of the sweep's
    back-to-back pass its compute-bound kernels fill, as the sweep's record gives a run's own."""
    layer = layer_ops(Shapes.of(cfg)).sustained()
    compute = sum(found[(k.name, k.dims, dtype)] for k in layer if k.flops > 0)
    total = sum(found[(k.name, k.dims, dtype)] for k in layer)
    return PowerLimit(hw.sustained.factor(layer_efficiency(hw, cfg, found, dtype)),
                      compute / total if total > 0 else 1.0, hw.sustained.threshold_share)


def hardware_calibration(cfg: RunConfig, hw: Hardware) -> Calibration:
    """The Calibration of cfg's kernels, rates and groups on hardware `hw` (ConfigError for a dtype it has no peak
    of; CalibrationMissing for a kernel it cannot price)."""
    dtype, grad_dtype = cfg.train.params_dtype, cfg.train.grad_dtype
    found = {(k.name, k.dims, dtype): _seconds(hw, k, dtype, grad_dtype) for k in stage_kernels(cfg)}
    step = optimizer_rate(Shapes.of(cfg)).name
    rates = {(step, dtype): rate_seconds_per_element(hw, step, dtype, grad_dtype),
             ("grad_buffer.zero", grad_dtype): rate_seconds_per_element(hw, "grad_buffer.zero", dtype, grad_dtype)}
    limit = power_limit(hw, cfg, found, dtype)
    unmodelled = unmodelled_host(cfg) or unpriced_host(cfg, hw.host) or (
        None if hw.host is not None else f"host timeline off: {hw.path} has no host block")
    return Calibration(kernels=found, rates=rates, comm=comm_model(cfg, hw),
                       device=f"{hw.name} (hardware file {hw.version})",
                       sustained=limit.full_factor, power=limit,
                       host=None if unmodelled else hw.host, host_note=unmodelled)
