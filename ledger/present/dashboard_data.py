"""The figures the dashboard shows that ledger.present.loaders does not return as such: a run's headline figures and
layout, the static-memory terms of the waterfall, and the ideal pipeline schedule. Torch-free pure functions of a
run's RunView (or of plain values), like ledger.present.loaders, so the dashboard can cache them.

Nothing here is a new estimate: headline figures are picked from the reconciliation rows, the static terms are the
formulas' StaticBytes and the engine's inventory records, the ideal schedule is the ledger's own schedule replayed on
its global clock (ledger.models.schedule, the chart `train-ledger schedule` prints).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from common.config import RunConfig
from common.errors import UserError
from common.events import InventoryRecord
from ledger.evidence.run import RunEvidence
from ledger.models.formulas.bubble import bubble
from ledger.models.formulas.buffer_layout import expert_rank_buffers, rank_buffers
from ledger.models.formulas.bytes_per_param import DTYPE_BYTES
from ledger.models.formulas.static_memory import StaticBytes, static_bytes_split
from ledger.models.schedule import FORWARD, simulate
from ledger.present.headline import figures
from ledger.present.loaders import RunView, load_rows, open_run
from ledger.reconcile.checkpoint import resumed_from

# Waterfall terms in the order memory fills up, and the inventory kinds (the engine's `tensor_kind`) behind each.
STATIC_TERMS: dict[str, tuple[str, ...]] = {
    "params": ("param_buffer",),
    "grads": ("grad_buffer",),
    "padding": (),
    "master weights": ("master_params",),
    "fp32 grad copy": ("master_grads",),
    "Adam states": ("adam_exp_avg", "adam_exp_avg_sq"),
}


def run_config(view: RunView) -> RunConfig | None:
    return view.evidence.config


def layout_text(view: RunView) -> str:
    """World size and TP / CP / DP / PP (/ VPP) sizes as the run's config states them."""
    s = view.evidence.layout
    if s is None:
        return f"{view.evidence.world_size} ranks (no config: layout unknown)"
    text = f"{s.world_size} = TP{s.tp} x CP{s.cp} x DP{s.dp} x PP{s.pp}"
    return text + (f" (VPP{s.vpp})" if s.vpp > 1 else "")


def config_text(view: RunView) -> str:
    """The model shape and the training flags that move the ledger's figures, on one line."""
    cfg = view.evidence.config
    if cfg is None:
        return "no config"
    model, train = cfg.model, cfg.train
    shape = (f"{cfg.model_preset or 'custom'}: L{model.num_layers} h{model.hidden_size} f{model.ffn_hidden_size} "
             f"s{model.seq_length} v{model.vocab_size}")
    dtype = "bf16" if train.bf16 else "fp16" if train.fp16 else "fp32"
    flags = [name for on, name in ((train.use_distributed_optimizer, "dist-opt"),
                                   (train.overlap_grad_reduce, "overlap-grad"),
                                   (train.overlap_param_gather, "overlap-param"),
                                   (cfg.parallel.sequence_parallel, "SP")) if on]
    return f"{shape}; {dtype}; mbs {train.micro_batch_size} gbs {train.global_batch_size}" + \
        (f"; {' '.join(flags)}" if flags else "")


def headline(view: RunView) -> dict[str, dict[str, Any]]:
    """The run's headline figures (ledger.present.headline), each {value, unit, source}."""
    return figures(load_rows(view))


def static_breakdown(view: RunView) -> list[dict[str, Any]]:
    """Per rank, the static terms after the first step: predicted (formulas) and inventory (engine records) bytes,
    and for an MoE model the part of each in the expert buffers and their optimizer state (`expert_predicted`; the
    engine's expert buffers are inventory records of their own, `expert_inventory`; its optimizer records cover
    dense and expert elements together, so those terms have no inventory split). Padding is shown apart from params
    and grads (the formulas count it inside both buffers)."""
    ev = view.evidence
    moe = ev.config is not None and ev.config.model.is_moe
    out = []
    for rank, r in sorted(ev.ranks.items()):
        predicted, expert = _predicted_terms(ev.config, r.coords) if ev.config is not None else ({}, {})
        inventory = _inventory_terms(r.inventory)
        expert_inventory = _inventory_terms([rec for rec in r.inventory if rec.expert])
        rows = []
        for term in STATIC_TERMS:
            row = {"term": term, "predicted": predicted.get(term), "inventory": inventory.get(term)}
            if moe:
                row.update(expert_predicted=expert.get(term), expert_inventory=expert_inventory.get(term)
                           if STATIC_TERMS[term] in ((), ("param_buffer",), ("grad_buffer",)) else None)
            rows.append(row)
        out.append({"rank": rank, "stage": r.stage, "terms": rows})
    return out


def _predicted_terms(cfg: RunConfig, coords: dict[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """(the rank's terms, their expert part: empty for a dense model)."""
    parts = static_bytes_split(cfg, coords["tp"], coords["pp"], coords["dp"], "after_first_step")
    dense, experts = rank_buffers(cfg, coords["pp"]), expert_rank_buffers(cfg, coords["pp"])
    total = _terms(cfg, parts["dense"] + parts["expert"], dense + experts)
    return total, _terms(cfg, parts["expert"], experts) if experts else {}


def _terms(cfg: RunConfig, s: StaticBytes, buffers: list) -> dict[str, int]:
    padding = sum(b.padding for b in buffers)
    pb, gb = DTYPE_BYTES[cfg.train.params_dtype], DTYPE_BYTES[cfg.train.grad_dtype]
    return {"params": s.param_buffer - padding * pb, "grads": s.grad_buffer - padding * gb, "padding": s.padding,
            "master weights": s.master_params, "fp32 grad copy": s.grad_fp32_copy, "Adam states": s.adam_m + s.adam_v}


def _inventory_terms(records: list[InventoryRecord]) -> dict[str, int]:
    """Inventory bytes by waterfall term; empty when no record carries a kind the waterfall knows."""
    terms = {term: 0 for term in STATIC_TERMS}
    matched = False
    for rec in records:
        term = next((t for t, kinds in STATIC_TERMS.items() if rec.tensor_kind in kinds), None)
        if term is None:
            continue
        matched = True
        pad = rec.padding_bytes or 0
        terms[term] += (rec.bytes or 0) - pad
        terms["padding"] += pad
    return terms if matched else {}


def _losses(ev: RunEvidence) -> list[tuple[int, float]]:
    """(iteration, loss) of every step of the run, from the first rank that logged steps (every rank logs the
    global batch's loss: the engine reduces it over DP and broadcasts it from the last pipeline stage)."""
    for _, r in sorted(ev.ranks.items()):
        steps = [(s.step, s.loss) for s in r.steps if s.loss is not None and s.step is not None]
        if steps:
            return sorted(steps)
    return []


def _earlier_run(run_dir: Path, saved_by: str) -> Path | None:
    """The run directory that saved the checkpoint a run resumed from: where the checkpoint says it was, else a
    run of that name beside this one (the runs were moved together, or copied to another machine)."""
    for candidate in (Path(saved_by), run_dir.parent / Path(saved_by).name):
        if candidate.is_dir() and candidate.resolve() != run_dir.resolve():
            return candidate
    return None


def loss_curve(view: RunView) -> dict[str, Any]:
    """The loss per iteration across resumes: a run that resumed from a checkpoint (not --finetune) continues the
    run that saved it (the load event's `saved_by_run_dir`, written by engine.checkpointing into the checkpoint's
    layout.json), so its curve is that run's steps up to the iteration it resumed from (recursively: that run may
    have resumed too) followed by its own. Returns `steps` [{iteration, loss, run}] with each iteration once,
    `resumes` [{iteration, run, from_run, joined}] (where a vertical marker goes; joined: from_run's steps are on
    the curve) and `notes` (an earlier run that could not
    be found or read: its steps are missing from the curve)."""
    return _joined(view.evidence, frozenset())


def _joined(ev: RunEvidence, seen: frozenset[str]) -> dict[str, Any]:
    """loss_curve of a run, `seen` the runs already on the curve (a loop of runs naming each other ends)."""
    path = ev.run_dir
    own = [{"iteration": i, "loss": loss, "run": str(path)} for i, loss in _losses(ev)]
    found = resumed_from(ev)
    if found is None or found[1].finetune:
        return {"steps": own, "resumes": [], "notes": []}
    iteration, load = found
    resume = {"iteration": iteration, "run": str(path), "from_run": load.saved_by_run_dir, "joined": False}
    earlier = _earlier_run(path, resume["from_run"]) if resume["from_run"] else None
    if earlier is None or str(earlier.resolve()) in seen:
        why = ("its checkpoint does not record one" if not resume["from_run"] else
               f"{resume['from_run']} is not there" if earlier is None else "the runs resume from each other")
        return {"steps": own, "resumes": [resume],
                "notes": [f"resumed from iteration {iteration}; the run that saved it is not shown ({why})"]}
    resume["from_run"] = str(earlier)
    try:
        before = _joined(open_run(earlier).evidence, seen | {str(path.resolve())})
    except UserError as exc:
        return {"steps": own, "resumes": [resume], "notes": [f"resumed from iteration {iteration} of {earlier}, "
                                                             f"which cannot be read: {exc}"]}
    resume["joined"] = True
    return {"steps": [s for s in before["steps"] if s["iteration"] <= iteration] + own,
            "resumes": [r for r in before["resumes"] if r["iteration"] <= iteration] + [resume],
            "notes": before["notes"]}


def pipeline_shape(view: RunView) -> dict[str, int] | None:
    """(p, m, v) of the run's schedule, None when the config does not say."""
    cfg = view.evidence.config
    if cfg is None:
        return None
    return {"pp": cfg.parallel.pipeline_model_parallel_size, "microbatches": cfg.num_microbatches,
            "vpp": cfg.parallel.virtual_pipeline_model_parallel_size or 1}


def ideal_schedule(pp: int, microbatches: int, vpp: int = 1) -> dict[str, Any]:
    """The schedule (ledger.models.schedule) on its global clock, one cell per forward or backward of equal cost: cells
    (stage, slot, kind, microbatch, chunk, label), the chart's bubble fraction and the closed form."""
    timeline = simulate(pp, microbatches, vpp)
    clock = timeline.cells()
    cells = [{"stage": stage, "slot": slot, "kind": "forward" if item.kind == FORWARD else "backward",
              "microbatch": item.microbatch, "chunk": item.chunk, "label": item.label(vpp > 1)}
             for stage, row in enumerate(clock) for slot, item in enumerate(row) if item is not None]
    return {"cells": cells, "slots": len(clock[0]) if clock else 0, "bubble_fraction": timeline.bubble_fraction(),
            "analytic_bubble_fraction": bubble(pp, microbatches, vpp).of_wall_time}


def rank_timing(view: RunView, rank: int, step: int) -> list[dict[str, Any]]:
    """One rank's timer records in one step (compute, communication, optimizer) on the timers' own clock
    (`start_s` / `end_s`, the clock ledger.present.loaders.bucket_intervals reports), for drawing buckets over
    compute."""
    r = view.evidence.ranks.get(rank)
    if r is None:
        return []
    return [{"name": t.name, "category": t.category, "start": t.start_s, "end": t.end_s, "bucket": t.bucket,
             "microbatch": t.microbatch}
            for t in r.timing if t.step == step and t.category != "iteration"]


def trace_list(view: RunView) -> list[dict[str, Any]]:
    """The run's per-rank profiler traces: rank, step range, file name relative to the run, size in bytes."""
    return [{"rank": t.rank, "steps": f"{t.start}-{t.end}", "file": str(t.path.relative_to(view.run_dir)),
             "bytes": t.path.stat().st_size} for t in view.evidence.traces]


def merged_trace(view: RunView, out: str) -> dict[str, Any]:
    """Merge the run's traces into `out` (ledger.present.trace_export, the code behind `train-ledger export-trace`);
    what the export says about itself: ranks, events, clock offsets and the ranks it could not align."""
    from ledger.present.trace_export import export

    result = export(view.evidence, out)
    return {"out": str(result.out), "ranks": result.ranks, "events": result.events,
            "offsets_us": result.offsets_us, "uncorrected": result.uncorrected}
