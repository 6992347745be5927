"""A run as the report, what-if and the dashboard read it: `RunView`, the run's evidence read once and its
reconciliation (the written RUN/ledger/reconciliation.json, else computed once from the same evidence), and the
figures pages show, as functions of a RunView returning plain values (lists and dicts, safe to cache). Nothing here is
a new estimate: every figure comes from the reconciliation or from the evidence it reads.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from common.errors import InputError
from common.run_dir import MANIFEST, read_manifest
from ledger.evidence.layout import group_lists
from ledger.evidence.megatron import ingest as ingest_megatron
from ledger.evidence.megatron.tensorboard import EVENTS_GLOB
from ledger.evidence.read import read_run
from ledger.evidence.run import RunEvidence, collect_run, cpu_sharing
from ledger.evidence.steps import run_steps
from ledger.present.units import rank_label
from ledger.reconcile.overlap import timer_intervals
from ledger.reconcile.pipeline import pipeline_columns, stage_slots
from ledger.reconcile.run import CSV_NAME, JSON_NAME, LEDGER_DIR, TraceWork, reconcile_evidence
from ledger.reconcile.time_rows import TimeSources


@dataclass
class RunView:
    """Each part read on first use and kept: the manifest alone serves a runs table, the evidence a page."""
    run_dir: Path
    work: TraceWork = TraceWork()  # how a reconciliation computed here reads the run's traces
    # the time model's prices beyond the run's sweeps (report --hardware / --calibration): a reconciliation computed
    # with them, never the stored one
    sources: TimeSources | None = None
    _manifest: dict[str, Any] | None = field(default=None, repr=False)
    _evidence: RunEvidence | None = field(default=None, repr=False)
    _reconciliation: dict[str, Any] | None = field(default=None, repr=False)

    @classmethod
    def of(cls, evidence: RunEvidence) -> "RunView":
        return cls(evidence.run_dir, _manifest=evidence.manifest, _evidence=evidence)

    @property
    def manifest(self) -> dict[str, Any]:
        """Ours read alone; a Megatron-LM run's is built by its reader from its files (so that reads them all)."""
        if self._manifest is None:
            self._manifest = (self.evidence.manifest if ingest_megatron.is_megatron_run(self.run_dir)
                              else read_manifest(self.run_dir))
        return self._manifest

    @property
    def evidence(self) -> RunEvidence:
        if self._evidence is None:
            self._evidence = (read_run(self.run_dir) if ingest_megatron.is_megatron_run(self.run_dir)
                              else collect_run(self.run_dir, self.manifest))
        return self._evidence

    @property
    def reconciliation(self) -> dict[str, Any]:
        """RUN/ledger/reconciliation.json when `train-ledger reconcile` wrote it and no sources are given, else
        computed now (not written)."""
        if self._reconciliation is None:
            path = self.run_dir / LEDGER_DIR / JSON_NAME
            if self.sources is None and path.is_file():
                try:
                    self._reconciliation = json.loads(path.read_text(encoding="utf-8"))
                except json.JSONDecodeError as exc:
                    raise InputError(path, f"corrupt JSON ({exc.msg}); rerun `train-ledger reconcile`") from None
            else:
                self._reconciliation = reconcile_evidence(self.evidence, self.work,
                                                          self.sources or TimeSources()).to_dict()
        return self._reconciliation


def open_run(run_dir: str | Path, work: TraceWork = TraceWork(), sources: TimeSources | None = None) -> RunView:
    return RunView(Path(run_dir), work, sources)


def list_runs(root: str, view_of: Callable[[Path], RunView] = open_run) -> list[dict[str, Any]]:
    """Every run directory up to two levels under root (ours: manifest.json; Megatron-LM's: run.sh's
    megatron_run.json, or the folder holding the TensorBoard directory Megatron-LM wrote), newest first, with what
    the run table shows, from each run's manifest as `view_of` reads it (the dashboard passes its cached views, so
    a page lists runs without reading a manifest twice). A directory that fails to read is listed with its error."""
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
            m = view_of(run).manifest
            entry.update(run_id=m.get("run_id"), framework=m.get("framework"), status=m.get("status"),
                         world_size=m.get("world_size"), started=m.get("started"))
        except InputError as exc:
            entry["error"] = str(exc)
        out.append(entry)
    return sorted(out, key=lambda e: str(e.get("started") or ""), reverse=True)


def manifest(view: RunView) -> dict[str, Any]:
    return view.manifest


def shared_cores(view: RunView) -> str:
    """The sentence saying the run's CPU ranks outnumber their cores ("" when they do not): its timings are not
    judged (ledger.evidence.run.cpu_sharing)."""
    return cpu_sharing(view.evidence) or ""


def load_reconciliation(view: RunView) -> dict[str, Any]:
    return view.reconciliation


def load_summary(view: RunView) -> dict[str, Any]:
    """Run identity, verdict counts and what is missing: the header of a run's page."""
    data = view.reconciliation
    return {"run": data["run"], "verdicts": data["verdicts"], "missing": data["missing"]}


def load_rows(view: RunView) -> list[dict[str, Any]]:
    return view.reconciliation["rows"]


def csv_path(view: RunView) -> str | None:
    path = view.run_dir / LEDGER_DIR / CSV_NAME
    return str(path) if path.is_file() else None


def memory_timeline(view: RunView) -> list[dict[str, Any]]:
    """Per rank and step: allocated, peak allocated, reserved (memory_stats) and NVML used, in bytes (None where
    not measured, e.g. CPU runs, which carry RSS instead)."""
    out = []
    for rank, r in sorted(view.evidence.ranks.items()):
        nvml: dict[int | None, int] = {}
        for n in r.nvml:
            if n.used_bytes is not None:
                nvml[n.step] = max(nvml.get(n.step, 0), n.used_bytes)
        for m in r.memory_steps:
            out.append({"rank": rank, "stage": r.stage, "step": m.step, "allocated": m.allocated, "peak": m.peak,
                        "reserved": m.reserved, "nvml_used": nvml.get(m.step), "rss": m.rss_bytes})
    return out


CUDA_GRAPHS = "CUDA graphs (static tensors, gradients, workspaces)"


def memory_waterfall(view: RunView) -> list[dict[str, Any]]:
    """Per rank, the terms that add up to NVML-measured memory, from the reconciliation rows: static, what CUDA
    graphs keep (a graphed run), activations and transients at the peak, reserved beyond the peak, memory outside
    PyTorch; each with its predicted value where the formulas give one."""
    by_rank: dict[int, dict[str, dict[str, Any]]] = {}
    for row in load_rows(view):
        if row["metric"].startswith("memory.") and row["rank"] is not None:
            by_rank.setdefault(row["rank"], {})[row["metric"]] = row
    out = []
    for rank, rows in sorted(by_rank.items()):
        static = rows.get("memory.static_after_first_step", {})
        peak = rows.get("memory.peak_allocated", {})
        graphs = rows.get("memory.cuda_graphs")  # --cuda-graph-impl local: what the capture keeps, apart
        held = {key: _sum(static.get(key), graphs.get(key) if graphs else 0) for key in ("predicted", "measured")}
        out.append({"rank": rank, "terms": [
            _term("static", static.get("predicted"), static.get("measured")),
            *([_term(CUDA_GRAPHS, graphs.get("predicted"), graphs.get("measured"))] if graphs else []),
            _term("activations + transients", _gap(peak.get("predicted"), held["predicted"]),
                  _gap(peak.get("measured"), held["measured"])),
            _term("reserved beyond peak", None, rows.get("memory.fragmentation", {}).get("measured")),
            _term("outside PyTorch (CUDA context, NCCL, cuBLAS)", None,
                  rows.get("memory.outside_pytorch", {}).get("measured")),
        ], "nvml_used": rows.get("memory.device_total", {}).get("measured")})
    return out


def _sum(a: float | None, b: float | None) -> float | None:
    return a + b if a is not None and b is not None else None


def _term(name: str, predicted: float | None, measured: float | None) -> dict[str, Any]:
    return {"term": name, "predicted": predicted, "measured": measured}


def _gap(a: float | None, b: float | None) -> float | None:
    return a - b if a is not None and b is not None else None


def stage_timeline(view: RunView, step: int | None = None) -> list[dict[str, Any]]:
    """Forward / backward bars of every rank for one step (default: the last step with timers), times in seconds
    from the start of that step's pipeline (earliest forward of the rank's pipeline column)."""
    out = []
    for column in pipeline_columns(view.evidence).values():
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


def bucket_intervals(view: RunView) -> list[dict[str, Any]]:
    """Every DP bucket collective from the timers: rank, step, bucket, op, start, end (s from the step start),
    overlapped and exposed seconds, and `counted`: whether the reconciliation's overlap rows count its step (the
    steps StepSelection.timed keeps), so that a page's means are the report's."""
    ev = view.evidence
    selection = run_steps(ev)
    out = []
    for r in ev.ranks.values():
        counted, _ = selection.timed({t.step for t in r.timing})
        out += [dict(asdict(i), exposed=i.exposed, counted=i.step in counted) for i in timer_intervals(r)]
    return out


def topology(view: RunView) -> dict[str, Any]:
    """World size, parallel sizes, each rank's coordinates and label, and the TP / DP / PP group lists (empty
    without a config: no layout to derive them from)."""
    ev = view.evidence
    layout = ev.layout
    lists = group_lists(layout) if layout is not None else {}
    ranks = [{"rank": rank, "coords": ev.coords(rank), "label": rank_label(rank, ev.coords(rank))}
             for rank in range(ev.world_size)]
    sizes = {"tp": layout.tp, "pp": layout.pp, "dp": layout.dp} if layout is not None else \
        {"tp": None, "pp": None, "dp": None}
    return {"world_size": ev.world_size, **sizes, "ranks": ranks,
            "groups": {k: lists.get(k, []) for k in ("tp", "dp", "pp")}}
