"""What report.md (ledger.present.report_md) and report.html (ledger.present.report_html) both show, gathered once:
the reconciliation and the loaders' views, so the report shows nothing the ledger did not compute.

Written for a person: rows that agree across ranks are one line (ledger.present.row_groups: the range over the
ranks, the worst verdict and its rank), caveats that many rows share are numbered notes stated once
(ledger.present.caveats), what is off comes first with its explanation, and every figure is written by
ledger.present.units. The full per-rank table is the reconciliation's own CSV / JSON beside the report; the step
decomposition's rows are shown as their own table (ledger.present.step_table).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ledger.present import loaders, units
from ledger.present.caveats import Cited, Notes
from ledger.present.headline import HEADLINES, figure, rows_of, verdict
from ledger.present.row_groups import FORMULA, PREDICTORS, REFERENCE, TIME_MODEL, Line, group
from ledger.reconcile.rows import NOT_ON_CPU, WARN_FACTOR
from ledger.reconcile.run import CSV_NAME, JSON_NAME

# The one Nsight Systems command, for the report and the dashboard's Traces page alike: NVTX carries the probes'
# ranges (and NCCL's own, when NCCL is built with NVTX), the capture range is the profiler window.
NSYS_COMMAND = ("nsys profile --trace=cuda,nvtx,osrt --capture-range=cudaProfilerApi --capture-range-end=stop "
                "-o RUN/nsys/rank%q{RANK} train-ledger train [Megatron flags] --run-dir RUN --nvtx --nsys-profile "
                "--profile-step-start A --profile-step-end B")
NSYS_NOTE = ("Nsight Systems: the probes emit NVTX ranges (--nvtx) and bracket the profiler window with "
             f"cudaProfilerStart/Stop (--nsys-profile); capture per rank with `{NSYS_COMMAND}`.")
SECTIONS = {"memory": "Memory", "pipeline": "Pipeline", "time": "Time model", "overlap": "Communication overlap",
            "comm": "Communication volume", "throughput": "Throughput", "topology": "Rank groups",
            "checkpoint": "Checkpoints"}
COLUMN_TITLES = {FORMULA: "formula", TIME_MODEL: "time model", REFERENCE: "reference", "inventory": "inventory",
                 "measured": "measured"}
OFF_POINTER = "see What is off, above"
STEP_FAMILY = "step"  # ledger.reconcile.step_decomposition's rows: shown as "Where the step went"

VERDICT_MEANINGS = (
    f"ok: the measurement lies within its row's tolerance of the prediction; warn: within {WARN_FACTOR:g} times it; "
    "off: beyond. n/a: "
    "nothing judges the figure (no prediction or no measurement, or set aside, as its note says). identity: both "
    "sides are one quantity by construction (the engine counts it from the config fields the formula reads): shown, "
    "never counted as agreement.")


@dataclass
class View:
    """Everything both renderings need, gathered once."""
    data: dict[str, Any]
    lines: list[Line]
    notes: Notes
    waterfall: list[dict[str, Any]]
    timeline: list[dict[str, Any]]
    buckets: list[dict[str, Any]]
    topology: dict[str, Any]

    def refer(self, text: str) -> str:
        """'note [n]' when `text` is a note, else the text itself: a caveat is written out once."""
        return f"note [{self.notes.texts.index(text) + 1}]" if text in self.notes.texts else text

    def explanation(self, line: Line) -> str:
        """The line's explanation with its notes cited by number, exponent notation written out."""
        return units.plain(self.notes.cite(line.explanation()).inline())


def build(run: loaders.RunView) -> View:
    data = run.reconciliation
    lines = group(data["rows"])
    tabled = [line for line in lines if line.metric.split(".")[0] != STEP_FAMILY]  # the step's rows: their own table
    return View(data=data, lines=lines, notes=Notes.of([line.explanation() for line in tabled]),
                waterfall=loaders.memory_waterfall(run), timeline=loaders.stage_timeline(run),
                buckets=loaders.bucket_intervals(run), topology=loaders.topology(run))


def headline(rows: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], str]]:
    """(label, figure, verdict) of every headline (ledger.present.headline), as the demo and the dashboard show them."""
    return [(h.label, figure(rows, h), verdict(rows_of(rows, h))) for h in HEADLINES]


def sections(lines: list[Line]) -> dict[str, list[Line]]:
    """The lines by section; the step decomposition's rows are left to their own table (ledger.present.step_table)."""
    out: dict[str, list[Line]] = {}
    for line in lines:
        family = line.metric.split(".")[0]
        if family != STEP_FAMILY:
            out.setdefault(SECTIONS.get(family, "Other"), []).append(line)
    return out


def columns(lines: list[Line]) -> list[str]:
    """The value columns a section needs: each predictor, the inventory and the measurement, where any line has
    a figure in it."""
    cells = [line.cells() for line in lines]
    return [c for c in (*PREDICTORS, "inventory", "measured") if any(cell[c] != units.DASH for cell in cells)]


@dataclass
class OffList:
    """The lines that are off, each with its explanation: the notes every one of them cites are named once at the
    head of the list (`shared`, note numbers), any other note they cite by its number, as every line does (a note's
    text is written once, in the Notes)."""
    shared: list[int]
    items: list[tuple[Line, str]]

    def head(self) -> str:
        """'All of them carry note [1].' (empty when no note is shared)."""
        if not self.shared:
            return ""
        return f"All of them carry note{'s' if len(self.shared) > 1 else ''} " + \
            " ".join(f"[{n}]" for n in self.shared) + "."


def off_list(view: View) -> OffList:
    off = [line for line in view.lines if line.verdict() == "off"]
    cited = [view.notes.cite(line.explanation()) for line in off]
    common = set.intersection(*(set(c.notes) for c in cited)) if len(off) > 1 else set()
    items = [(line, units.plain(Cited(c.text, [n for n in c.notes if n not in common]).inline()))
             for line, c in zip(off, cited)]
    return OffList(sorted(common), items)


def off_item(line: Line, explanation: str) -> str:
    """What follows an off line's metric: '(where): measured ... against ...; worst ... . explanation' (no worst gap
    for a line judged against a bar rather than a reference: a threshold on a measured condition has none)."""
    gap = line.gap()
    worst = f"; worst {gap}" if gap != units.DASH else ""
    return f"({line.where()}): {against(line)}{worst}. {explanation}"


def against(line: Line) -> str:
    """'measured 34.7% against formula 11.11% and time model 19.3%': the line's figures in words; without a
    measurement, the engine's inventory against the predictions."""
    cells = line.cells()
    actual = "measured" if cells["measured"] != units.DASH or cells["inventory"] == units.DASH else "inventory"
    refs = [f"{COLUMN_TITLES[c]} {cells[c]}" for c in (*PREDICTORS, "inventory")
            if c != actual and cells[c] != units.DASH]
    return f"{actual} {cells[actual]}" + (f" against {' and '.join(refs)}" if refs else "")


def summary(data: dict[str, Any], lines: list[Line]) -> str:
    run = data["run"]
    counts = ", ".join(f"{n} {k}" for k, n in data["verdicts"].items())
    return (f"{run['framework']}, status {run['status']}, world size {run['world_size']}. Verdicts: {counts} "
            f"({len(data['rows'])} rows, one per figure and rank, in {CSV_NAME} / {JSON_NAME} beside this report). "
            f"{VERDICT_MEANINGS} Below, rows that agree across ranks are one line ({len(lines)} lines): the range over "
            f"the ranks, the worst verdict and the rank that has it." + resumed(data["rows"]))


def resumed(rows: list[dict[str, Any]]) -> str:
    """' Resumed from the checkpoint of iteration N: this run loaded DIR (saved by run RUN) ...' for a run that
    loaded one at start (else empty): the iteration, the checkpoint and the run that saved it."""
    found = [r for r in rows if r["metric"] == "checkpoint.resumed_from_iteration"]
    return (f" Resumed from the checkpoint of iteration {found[0]['measured']:.0f}: {found[0]['explanation']}."
            if found else "")


def unmeasured_memory(view: View) -> str | None:
    """Why no rank has a measured memory term (None when some rank has one)."""
    if any(t["measured"] is not None for w in view.waterfall for t in w["terms"]):
        return None
    memory = [r for r in view.data["rows"] if r["metric"].startswith("memory.")]
    if any(NOT_ON_CPU in r["explanation"] for r in memory):
        return NOT_ON_CPU
    return "the run recorded no memory_stats (the memory probe was off, or no step completed)"


def waterfall_text(w: dict[str, Any], measured: bool) -> str:
    """One rank's memory terms: measured with the prediction in brackets, or only predicted when nothing was
    measured."""
    if not measured:
        return "predicted " + "; ".join(f"{t['term']} {units.size(t['predicted'])}" for t in w["terms"]
                                        if t["predicted"] is not None)
    terms = "; ".join(f"{t['term']} {units.size(t['measured'])} [{units.size(t['predicted'])}]"
                      for t in w["terms"] if t["measured"] is not None or t["predicted"] is not None)
    return terms + (f"; NVML used {units.size(w['nvml_used'])}" if w["nvml_used"] is not None else "")


def grouped_by_text(items: list[tuple[int, str]]) -> list[tuple[list[int], str]]:
    """(ranks, text) with the ranks whose text is the same joined, in order of first appearance."""
    out: dict[str, list[int]] = {}
    for rank, text in items:
        out.setdefault(text, []).append(rank)
    return [(ranks, text) for text, ranks in out.items()]
