"""HolisticTraceAnalysis 0.5.0 as a cross-check of the ledger's own comm/comp overlap (install: pip install
'train-ledger[hta]'). Optional: without HTA, or without GPU traces, the reconciliation says so and goes on.

HTA's documented pitfalls, handled here:
  * rank detection: given a trace directory HTA finds each file's rank with the regex `"rank":\\s+(\\d+)`, which
    needs a space after the colon (compact JSON silently maps every file to rank 0). We hand HTA an explicit
    {rank: path} map built from our own file names, so the regex is never consulted.
  * the last ProfilerStep: HTA drops it as possibly incomplete (include_last_profiler_step=False). Our probes record
    one extra step for that reason; the ledger's figure it is compared with drops the same step.
  * communication arguments: HTA's default parser keeps only a minimum set of event args, without the collective
    ones ("Collective name", "In msg nelems", "Group size", ...). The parser's default config is extended with
    ARGS_COMMUNICATION before loading, and restored afterwards.
HTA counts GPU kernels only (CPU ops have stream -1), so CPU (gloo) traces are not cross-checked.
"""
from __future__ import annotations

import contextlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path

from common.intervals import covered, union
from ledger.evidence.traces import TraceSummary
from ledger.reconcile.rows import Row, row

HTA_TOL = 0.05


def available() -> bool:
    return importlib.util.find_spec("hta") is not None


def ledger_overlap(summary: TraceSummary) -> float | None:
    """HTA's definition on our summary: comm-kernel time covered by compute kernels / comm-kernel time, over every
    ProfilerStep but the last (the one HTA drops)."""
    windows = summary.windows()
    if len(windows) < 2:
        return None
    kept = sorted(windows)[:-1]
    lo, hi = windows[kept[0]][0], windows[kept[-1]][1]
    comm = union((c.start, c.end) for c in summary.collectives if lo <= c.start <= hi)
    total = sum(e - s for s, e in comm)
    if total == 0:
        return None
    busy = union(summary.compute)
    return sum(covered(span, busy) for span in comm) / total


def hta_overlap(files: dict[int, Path]) -> dict[int, float]:
    """HTA's comp_comm_overlap per rank, as a fraction.

    Built from HTA's Trace with use_multiprocessing=False rather than TraceAnalysis: HTA's parallel parser forks a
    process pool, and a fork from a threaded host (the Streamlit dashboard computes reconciliations live) can
    deadlock. The traces are parsed one after the other instead; the figures are the same."""
    from hta.analyzers.communication_analysis import CommunicationAnalysis
    from hta.common.trace import Trace
    from hta.configs.parser_config import ParserConfig

    previous = ParserConfig.get_default_cfg()
    cfg = previous.clone()
    cfg.set_args(ParserConfig.get_minimum_args() + ParserConfig.ARGS_COMMUNICATION)
    ParserConfig.set_default_cfg(cfg)
    try:
        with contextlib.redirect_stdout(sys.stderr):  # `reconcile --json` owns stdout
            # HTA reads a relative path under its default trace_dir, not the working directory
            trace = Trace(trace_files={r: str(Path(p).resolve()) for r, p in files.items()})
            trace.load_traces(include_last_profiler_step=False, use_multiprocessing=False)
            df = CommunicationAnalysis.get_comm_comp_overlap(trace, visualize=False)
    finally:
        ParserConfig.set_default_cfg(previous)
    # HTA divides by the communication time it found: NaN when it kept no communication kernel
    return {int(r): float(p) / 100.0 for r, p in zip(df["rank"], df["comp_comm_overlap_pctg"]) if p == p}


@dataclass(frozen=True)
class CrossCheck:
    """What the cross-check keeps of one trace once its summary is dropped."""
    path: Path
    on_gpu: bool
    ledger_overlap: float | None


def cross_check_input(summary: TraceSummary) -> CrossCheck:
    return CrossCheck(summary.path, summary.on_gpu, ledger_overlap(summary) if summary.on_gpu else None)


def hta_rows(traces: dict[int, CrossCheck]) -> tuple[list[Row], list[str]]:
    """Cross-check rows, and what could not be checked (as `missing` sentences)."""
    gpu = {rank: t for rank, t in traces.items() if t.on_gpu}
    if not traces:
        return [], []
    if not gpu:
        return [], ["HTA cross-check skipped: traces have no GPU kernels (CPU run)"]
    if not available():
        return [], ["HTA cross-check skipped: HolisticTraceAnalysis not installed (pip install 'train-ledger[hta]')"]
    measured = hta_overlap({rank: t.path for rank, t in gpu.items()})
    rows = [row("overlap.hta_comm_comp_overlap", "rank", predicted=t.ledger_overlap, measured=measured.get(rank),
                unit="fraction", tolerance=HTA_TOL,
                explanation="HTA get_comm_comp_overlap (measured) vs the ledger's own computation from the same trace "
                            "(predicted column), both without the last ProfilerStep", rank=rank, source="hta")
            for rank, t in sorted(gpu.items())]
    return rows, []
