"""Pure functions over run directories for the dashboard (each is safe to wrap in st.cache_data: arguments are
paths and plain values, results are lists / dicts of plain values). The dashboard computes nothing the ledger
cannot: every figure here comes from the reconciliation or from the same evidence it reads.
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from common.errors import InputError
from common.run_dir import MANIFEST
from ledger.evidence.layout import Layout
from ledger.evidence.megatron import ingest as ingest_megatron
from ledger.evidence.megatron.tensorboard import EVENTS_GLOB
from ledger.evidence.run import rank_coords
from ledger.reconcile.memory import ALLOCATED, PEAK, RESERVED
from ledger.reconcile.overlap import timer_intervals
from ledger.reconcile.pipeline import pipeline_columns, stage_slots
from ledger.reconcile.run import CSV_NAME, JSON_NAME, LEDGER_DIR, TraceWork, gather, reconcile
from ledger.reconcile.topology import group_lists_of, rank_label


def list_runs(root: str) -> list[dict[str, Any]]:
    """Every run directory up to two levels under root (ours: manifest.json; Megatron-LM's: run.sh's
    megatron_run.json, or the folder holding the TensorBoard directory Megatron-LM wrote), newest first, with what
    the run table shows. A directory that fails to read is listed with its error."""
    root_path = Path(root)
    depths = ("", "*/", "*/*/")
    candidates = [p.parent for pattern in (MANIFEST, ingest_megatron.META) for depth in depths
                  for p in root_path.glob(depth + pattern)]
    candidates += [p.parent.parent for depth in depths for p in root_path.glob(f"{depth}*/{EVENTS_GLOB}")]
    out = []
    for run in sorted(set(candidates)):
        entry: dict[str, Any] = {"path": str(run), "name": run.name,
                                 "reconciled": (run / LEDGER_DIR / JSON_NAME).is_file()}
        try:
            m = load_manifest(str(run))
            entry.update(run_id=m.get("run_id"), framework=m.get("framework"), status=m.get("status"),
                         world_size=m.get("world_size"), started=m.get("started"))
        except InputError as exc:
            entry["error"] = str(exc)
        out.append(entry)
    return sorted(out, key=lambda e: str(e.get("started") or ""), reverse=True)


def load_manifest(run_dir: str) -> dict[str, Any]:
    """The run's manifest (for a Megatron-LM run, the one the ingest builds from its files)."""
    path = Path(run_dir)
    if ingest_megatron.is_megatron_run(path):
        return ingest_megatron.collect(path).manifest
    from common.run_dir import read_manifest

    return read_manifest(path)


def load_reconciliation(run_dir: str, work: TraceWork = TraceWork()) -> dict[str, Any]:
    """RUN/ledger/reconciliation.json when `train-ledger reconcile` wrote it, else computed now (not written), its
    traces read as `work` says."""
    path = Path(run_dir) / LEDGER_DIR / JSON_NAME
    if path.is_file():
        try:
            return json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise InputError(path, f"corrupt JSON ({exc.msg}); rerun `train-ledger reconcile`") from None
    return reconcile(run_dir, work).to_dict()


def load_summary(run_dir: str) -> dict[str, Any]:
    """Run identity, verdict counts and what is missing: the header of a run's page."""
    data = load_reconciliation(run_dir)
    return {"run": data["run"], "verdicts": data["verdicts"], "missing": data["missing"]}


def load_rows(run_dir: str) -> list[dict[str, Any]]:
    return load_reconciliation(run_dir)["rows"]


def csv_path(run_dir: str) -> str | None:
    path = Path(run_dir) / LEDGER_DIR / CSV_NAME
    return str(path) if path.is_file() else None


def memory_timeline(run_dir: str) -> list[dict[str, Any]]:
    """Per rank and step: allocated, peak allocated, reserved (memory_stats) and NVML used, in bytes (None where
    not measured, e.g. CPU runs, which carry RSS instead)."""
    ev = gather(run_dir)
    out = []
    for rank, r in sorted(ev.ranks.items()):
        nvml: dict[int, int] = {}
        for n in r.nvml:
            if "used_bytes" in n:
                nvml[n.get("step")] = max(nvml.get(n.get("step"), 0), int(n["used_bytes"]))
        for m in r.memory_steps:
            out.append({"rank": rank, "stage": r.stage, "step": m.get("step"), "allocated": m.get(ALLOCATED),
                        "peak": m.get(PEAK), "reserved": m.get(RESERVED), "nvml_used": nvml.get(m.get("step")),
                        "rss": m.get("rss_bytes")})
    return out


def memory_waterfall(run_dir: str) -> list[dict[str, Any]]:
    """Per rank, the terms that add up to NVML-measured memory, from the reconciliation rows: static, activations and
    transients at the peak, reserved beyond the peak, memory outside PyTorch; each with its predicted value where
    the formulas give one."""
    return waterfall_of(load_rows(run_dir))


def waterfall_of(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """memory_waterfall of reconciliation rows already loaded (the report's: not reconciled a second time)."""
    by_rank: dict[int, dict[str, dict[str, Any]]] = {}
    for row in rows:
        if row["metric"].startswith("memory.") and row["rank"] is not None:
            by_rank.setdefault(row["rank"], {})[row["metric"]] = row
    out = []
    for rank, rows in sorted(by_rank.items()):
        static = rows.get("memory.static_after_first_step", {})
        peak = rows.get("memory.peak_allocated", {})
        out.append({"rank": rank, "terms": [
            _term("static", static.get("predicted"), static.get("measured")),
            _term("activations + transients", _gap(peak.get("predicted"), static.get("predicted")),
                  _gap(peak.get("measured"), static.get("measured"))),
            _term("reserved beyond peak", None, rows.get("memory.fragmentation", {}).get("measured")),
            _term("outside PyTorch (CUDA context, NCCL, cuBLAS)", None,
                  rows.get("memory.outside_pytorch", {}).get("measured")),
        ], "nvml_used": rows.get("memory.device_total", {}).get("measured")})
    return out


def _term(name: str, predicted: float | None, measured: float | None) -> dict[str, Any]:
    return {"term": name, "predicted": predicted, "measured": measured}


def _gap(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def stage_timeline(run_dir: str, step: int | None = None) -> list[dict[str, Any]]:
    """Forward / backward bars of every rank for one step (default: the last step with timers), times in seconds
    from the start of that step's pipeline (earliest forward of the rank's pipeline column)."""
    ev = gather(run_dir)
    out = []
    for column in pipeline_columns(ev).values():
        slots = [s for r in column for s in stage_slots(r)]
        steps = sorted({s.step for s in slots})
        if not steps:
            continue
        chosen = step if step is not None else steps[-1]
        chosen_slots = [s for s in slots if s.step == chosen]
        if not chosen_slots:
            continue
        t0 = min(s.start for s in chosen_slots)
        out += [dict(asdict(s), start=s.start - t0, end=s.end - t0) for s in chosen_slots]
    return sorted(out, key=lambda s: (s["rank"], s["start"]))


def bucket_intervals(run_dir: str) -> list[dict[str, Any]]:
    """Every DP bucket collective from the timers: rank, step, bucket, op, start, end (s from the step start),
    overlapped and exposed seconds."""
    ev = gather(run_dir)
    return [dict(asdict(i), exposed=i.exposed) for r in ev.ranks.values() for i in timer_intervals(r)]


def topology(run_dir: str) -> dict[str, Any]:
    """World size, parallel sizes, each rank's coordinates and label, and the TP / DP / PP group lists."""
    manifest = load_manifest(run_dir)
    layout = Layout.from_manifest(manifest)
    lists = group_lists_of(manifest)
    ranks = []
    for rank in range(layout.world_size):
        coords = rank_coords(manifest, rank)
        ranks.append({"rank": rank, "coords": coords, "label": rank_label(rank, coords)})
    return {"world_size": layout.world_size, "tp": layout.tp, "pp": layout.pp, "dp": layout.dp, "ranks": ranks,
            "groups": {k: lists[k] for k in ("tp", "dp", "pp")}}
