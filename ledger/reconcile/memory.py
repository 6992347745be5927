"""Memory rows per rank: the NVML-measured device memory explained term by term.

    NVML used = static (params, grads, optimizer state; formula / inventory / memory_stats)
              + activations and transients at the peak (peak allocated - static)
              + allocator cache beyond the peak, fragmentation included (reserved - peak allocated)
              + memory outside PyTorch's allocator (NVML used - reserved: CUDA context, NCCL buffers, cuBLAS
                workspaces)
The Adam trap: torch's Adam creates exp_avg / exp_avg_sq at the first step, so the allocation measured "after
optimizer init" lacks 8 bytes per parameter element the rank owns; both phases get a row, and the gap its own.

On CPU there is no caching allocator: the static rows' measurement is the probes' tensor census at the lifecycle
point (probes.memory.tensor_census: the bytes of the storages behind every tensor the model and the optimizer hold,
each storage once), source "tensor_census"; what else is alive in the process (mock data, RoPE cache, the last
micro-batch, or a leak) is named beside it. The peak and the allocator rows stay unmeasured. A run recorded before
the census existed keeps an empty measured column and says so (NOT_ON_CPU).
"""
from __future__ import annotations

from common.config import RunConfig
from common.events import ALLOCATED, PEAK
from ledger.evidence.run import RankEvidence, RunEvidence
from ledger.models.formulas.cuda_graphs import graph_bytes
from ledger.models.formulas.device_memory import (
    DeviceOverheads,
    OutsidePyTorch,
    outside_pytorch,
)
from ledger.models.formulas.params import params_per_rank
from ledger.models.formulas.static_memory import static_bytes
from ledger.reconcile.memory_peak import peak_rows, workspaces_of
from ledger.reconcile.rows import NOT_ON_CPU, Row, identity_row, row, threshold_row

HELD = "held_tensor_bytes"
STATIC_TOL = 0.01
WORKSPACES = ("; on CUDA the first step's GEMMs also allocate cuBLAS / cuBLASLt workspaces through the caching "
              "allocator (tens of MiB per stream), which this measurement includes and the formula does not")
GRAPHS_TOL = 0.05  # an allocator figure, as the peak's
OUTSIDE_TOL = 0.02  # of NVML used: issue 15's bar for device memory explained
CENSUS_NOTE = ("; measured on CPU (no CUDA allocator): the storages behind the tensors the model and optimizer hold, "
               "by a census at the lifecycle point (torch's Adam adds a 4-byte step counter per parameter piece, which "
               "the formula leaves out)")


def memory_rows(ev: RunEvidence) -> list[Row]:
    rows: list[Row] = []
    for rank_ev in ev.ranks.values():
        device = ev.device(rank_ev.rank)
        rows += rank_rows(ev.config, rank_ev, device.name if device is not None else None)
    return rows


def rank_rows(cfg: RunConfig | None, r: RankEvidence, device_name: str | None = None) -> list[Row]:
    where = dict(rank=r.rank, stage=r.stage)
    pred_init = pred_step = params = None
    if cfg is not None:
        c = r.coords
        pred_init = static_bytes(cfg, c["tp"], c["pp"], c["dp"], "after_optimizer_init").total
        pred_step = static_bytes(cfg, c["tp"], c["pp"], c["dp"], "after_first_step").total
        params = params_per_rank(cfg, c["pp"])
    inv_step = sum(t.bytes or 0 for t in r.inventory) if r.inventory else None
    inv_init = (sum(t.bytes or 0 for t in r.inventory if t.allocated_at != "after_first_step")
                if r.inventory else None)
    cuda = r.on_cuda
    key, source, why_missing = static_measurement(r)
    meas_init = _point(r, "after_optimizer_init", key)
    meas_step = _point(r, "after_first_step", key)
    graphs = graphs_measured(r)
    if meas_step is not None and graphs is not None:  # the static state alone: the graphs have a row of their own
        meas_step -= graphs
    elif cfg is not None and cfg.implementation.graphed_layers:
        why_missing += "; the graphs' buffers are in this measurement (no memory points around their capture)"
    workspaces = WORKSPACES if cuda else ""
    rows = [
        row("memory.static_after_optimizer_init", "rank", predicted=pred_init, inventory=inv_init,
            measured=meas_init, unit="bytes", tolerance=STATIC_TOL,
            explanation="param + grad buffers (padding included) + fp32 main params; Adam moments do not exist yet"
                        + why_missing, source=source, **where),
        row("memory.static_after_first_step", "rank", predicted=pred_step, inventory=inv_step, measured=meas_step,
            unit="bytes", tolerance=STATIC_TOL,
            explanation="static state once the optimizer has stepped: adds Adam m, v (and an fp32 grad copy for "
                        "16-bit grads) on the owned shard" + workspaces + why_missing, source=source, **where),
        row("memory.adam_lazy_state", "rank", predicted=_gap(pred_step, pred_init), inventory=_gap(inv_step, inv_init),
            measured=_gap(meas_step, meas_init), unit="bytes", tolerance=STATIC_TOL,
            explanation="torch's Adam creates exp_avg/exp_avg_sq at the first step: 'after optimizer init' and "
                        "'after the first step' differ by 8 bytes per owned parameter element" + workspaces
                        + why_missing,
            source=source, **where),
    ]
    if params:
        rows.append(row("memory.bytes_per_param", "rank", predicted=pred_step / params,
                        inventory=inv_step / params if inv_step is not None else None,
                        measured=meas_step / params if meas_step is not None else None, unit="bytes/param",
                        tolerance=STATIC_TOL,
                        explanation=f"static bytes / {params:,} parameters on this rank (bucket padding and uneven "
                                    "distributed-optimizer shards move it off the textbook table)" + why_missing,
                        source=source, **where))
    if cfg is not None and cfg.implementation.graphed_layers:
        rows.append(graphs_row(cfg, r, graphs, device_name))
    peak = peak_rows(cfg, r, device_name, "" if cuda else f"; {NOT_ON_CPU}")
    split = cuda and cfg is not None and cfg.implementation.megatron
    rows += peak if split else [x for x in peak if x.metric == "memory.peak_allocated"]
    if cuda:
        rows += allocator_rows(r, predicted_outside(cfg, r, device_name))
    return rows


def graphs_measured(r: RankEvidence) -> int | None:
    """What the CUDA graphs' capture left allocated (the memory points around it), None without them."""
    before, after = (r.memory_points.get(p) for p in ("before_cuda_graphs", "after_cuda_graphs"))
    if before is None or after is None or before.allocated is None or after.allocated is None:
        return None
    return after.allocated - before.allocated


def graphs_row(cfg: RunConfig, r: RankEvidence, measured: int | None, device_name: str | None) -> Row:
    """memory.cuda_graphs: the capture's allocated bytes against what ledger/models/formulas/cuda_graphs.py says
    make_graphed_callables keeps; the static rows' measurement leaves them out."""
    workspaces, source = workspaces_of(device_name)
    terms = graph_bytes(cfg, workspaces)
    split = "; ".join(f"{name.removeprefix('CUDA graphs: ')} {n:,} B" for name, n in terms.items())
    absent = "" if measured is not None else "; not measured: the run has no memory points around its capture"
    return row("memory.cuda_graphs", "rank", predicted=sum(terms.values()), measured=measured, unit="bytes",
               tolerance=GRAPHS_TOL, explanation=f"allocated by the capture of every layer's CUDA graphs: {split} "
                                                  f"({source}; a capture allocated 5 MiB more than this on two H200 "
                                                  f"shapes, not identified){absent}",
               source="events", rank=r.rank, stage=r.stage)


def static_measurement(r: RankEvidence) -> tuple[str, str, str]:
    """(memory record key, source, explanation suffix) of the static rows' measurement on this rank: memory_stats'
    allocated bytes on CUDA, the tensor census on CPU, nothing on a CPU run recorded before the census."""
    if r.on_cuda:
        return ALLOCATED, "events", ""
    census = r.memory_points.get("after_first_step") or r.memory_points.get("after_optimizer_init")
    if census is None or census.held_tensor_bytes is None:
        return HELD, "events", f"; {NOT_ON_CPU}"
    held = census.held_tensor_bytes
    other = (census.tensor_bytes if census.tensor_bytes is not None else held) - held
    return HELD, "tensor_census", (f"{CENSUS_NOTE}; at {census.point} the process held {other:,} B more in "
                                   "other live tensors (mock data, RoPE cache, the last micro-batch)")


def predicted_outside(cfg: RunConfig | None, r: RankEvidence,
                      device_name: str | None) -> tuple[OutsidePyTorch | None, str]:
    """(the formula's memory outside PyTorch for this rank, or None, and where its constants come from)."""
    device = DeviceOverheads.known(device_name) if device_name else None
    if device is None:
        return None, (f"no calibration of {device_name or 'this device'} in ledger/models/calibration/ "
                      "(runs/bench/outside_pytorch.py measures one)")
    if cfg is None:
        return None, "no run config"
    return outside_pytorch(cfg, r.rank, device), f"calibration: {device.device}, {device.provenance}"


def allocator_rows(r: RankEvidence, outside: tuple[OutsidePyTorch | None, str] = (None, "")) -> list[Row]:
    """Fragmentation, memory outside PyTorch, retries and OOMs: figures only a CUDA run has."""
    where = dict(rank=r.rank, stage=r.stage)
    rows: list[Row] = []
    records = [m for m in r.memory_steps or list(r.memory_points.values())
               if m.reserved is not None and m.peak is not None]
    if not records:
        return rows
    top = max(records, key=lambda m: m.reserved or 0)
    reserved = top.reserved or 0
    frag = reserved - (top.peak or 0)
    rows.append(threshold_row("memory.fragmentation", "rank", measured=frag, warn_at=0.15 * reserved,
                              off_at=0.35 * reserved, unit="bytes",
                              explanation="reserved - peak allocated in the step where reserved peaked: cache the "
                                          "allocator holds beyond the step's own peak demand, fragmentation included "
                                          "(try PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True); warn above 15% of "
                                          "reserved, off above 35%", source="events", **where))
    rows += nvml_rows(r, reserved, frag, outside)
    retries = _step_max(r, "num_alloc_retries") or 0
    ooms = _step_max(r, "num_ooms") or 0
    rows.append(threshold_row("memory.alloc_retries", "rank", measured=retries, warn_at=1, off_at=100,
                              unit="count", explanation="cudaMalloc retries after freeing the cache: the allocator "
                                                        "ran out of room and synchronised", source="events", **where))
    rows.append(threshold_row("memory.ooms", "rank", measured=ooms, warn_at=1, off_at=1, unit="count",
                              explanation="out-of-memory errors the allocator raised", source="events", **where))
    return rows


def nvml_rows(r: RankEvidence, reserved: int, frag: int,
              outside: tuple[OutsidePyTorch | None, str]) -> list[Row]:
    """Memory outside PyTorch, other processes on the GPU and the device total, from the NVML sample where the
    device held the most for this process (its used bytes less what other processes held then)."""
    where = dict(rank=r.rank, stage=r.stage)
    samples = [n for n in r.nvml if n.used_without_others is not None]
    top = max(samples, key=lambda n: n.used_without_others or 0, default=None)
    own_used = top.used_without_others if top is not None else None
    non_torch = own_used - reserved if own_used is not None else None
    others = (top.other_processes_bytes or 0) if top is not None else 0
    predicted, provenance = outside
    terms = ", ".join(f"{name} {b / 2**20:,.0f} MiB" for name, b in predicted.terms.items()) if predicted else ""
    rows = [row("memory.outside_pytorch", "rank", measured=non_torch, unit="bytes",
                predicted=predicted.total if predicted else None, tolerance=0.0,
                abs_tolerance=OUTSIDE_TOL * own_used if own_used is not None else 0.0,
                explanation="NVML used" + (f" - other processes' {others:,} B" if others else "") + " - reserved"
                            + (f" = {terms}" if terms else "") + f"; {provenance}; judged to {OUTSIDE_TOL:.0%} of "
                            "NVML used (multi-rank communicators' peer buffers are not in the calibration)"
                            + ("" if r.nvml else "; no NVML samples (--nvml-interval)"), source="nvml", **where)]
    rows += other_process_rows(r, own_used)
    peak = _step_max(r, PEAK)
    if top is not None and peak is not None:
        rows.append(identity_row("memory.device_total", "rank", measured=top.used_bytes, unit="bytes",
                                 explanation=f"NVML used = peak allocated {peak:,} + reserved beyond peak {frag:,} + "
                                             f"outside PyTorch {non_torch:,} + other processes {others:,}: every "
                                             "term is measured, so the sum equals the measurement by construction "
                                             "(the peak is judged on memory.peak_allocated)", source="nvml", **where))
    return rows


def other_process_rows(r: RankEvidence, own_used: int | None) -> list[Row]:
    """memory.other_processes where NVML listed the device's processes: what the others held at most, which also
    compute beside the run. Warn at any byte; off from the outside-PyTorch row's bar (2% of NVML used), what
    would have put that row off had it not been subtracted."""
    where = dict(rank=r.rank, stage=r.stage)
    listed = [n for n in r.nvml if n.processes is not None]
    if not listed:
        return []
    split = [n.other_processes_bytes for n in listed if n.other_processes_bytes is not None]
    most = max(n.processes or 0 for n in listed)
    if not split:
        return [row("memory.other_processes", "rank", measured=None, unit="bytes", tolerance=0.0,
                    explanation=f"NVML lists up to {most} process(es) on this GPU but not this one (pids of another "
                                "PID namespace): what others hold cannot be told apart, so memory.outside_pytorch "
                                "counts it", source="nvml", **where)]
    return [threshold_row("memory.other_processes", "rank", measured=max(split), warn_at=1,
                          off_at=OUTSIDE_TOL * (own_used or 0) or 1, unit="bytes",
                          explanation=f"the most other processes held on this GPU at once (NVML's per-process "
                                      f"bytes; up to {most} process(es) listed): subtracted from NVML used before "
                                      "memory.outside_pytorch; they also computed beside the run, so its times are "
                                      "not this run's alone; warn at any byte, off from 2% of NVML used",
                          source="nvml", **where)]


def _point(r: RankEvidence, point: str, key: str) -> int | None:
    record = r.memory_points.get(point)
    return record.figure(key) if record is not None else None


def _step_max(r: RankEvidence, key: str) -> int | None:
    values = [v for m in [*r.memory_points.values(), *r.memory_steps] if (v := m.figure(key)) is not None]
    return max(values) if values else None


def _gap(after: float | None, before: float | None) -> float | None:
    return after - before if after is not None and before is not None else None


