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

Bounded: HTA loads a whole trace into pandas, so on a large run it would cost more than everything else. It runs on
a chosen subset of the traced GPU ranks (`HtaChoice`: by default the first and the last, `all`, `none`, or a list),
each rank in a process of its own under a memory cap and a time budget (ledger.reconcile.hta_job), as many at once
as there are trace workers (ledger.evidence.trace_pool.worker_count): at most workers x the cap of memory. Which
ranks were checked, left out, or ran out of their budget is said in the reconciliation's `missing`.
"""
from __future__ import annotations

import importlib.util
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Self

from common.intervals import covered, union
from ledger.evidence.rank_sets import RankChoice, left_out, ranks_text
from ledger.evidence.trace_pool import worker_count
from ledger.evidence.traces import TraceSummary
from ledger.reconcile.hta_job import run_capped
from ledger.reconcile.rows import Row, row

HTA_TOL = 0.05
MEMORY_MIB = 1024  # a 270k-event trace (llama3.2-1b, 16 layers, 8 micro-batches, 3 steps) needs about 650 MiB
SECONDS = 120.0  # per rank; that trace takes 10-25 s on a 2-core machine


@dataclass(frozen=True)
class HtaChoice(RankChoice):
    """Which traced GPU ranks HTA cross-checks (`--hta-ranks`), and the budget each gets."""
    memory_mib: int = MEMORY_MIB
    seconds: float = SECONDS

    @classmethod
    def parse(cls, text: str, flag: str = "--hta-ranks") -> Self:
        return super().parse(text, flag)  # built as cls, with the default budget


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


@dataclass(frozen=True)
class CrossCheck:
    """What the cross-check keeps of one trace once its summary is dropped."""
    path: Path
    on_gpu: bool
    ledger_overlap: float | None


def cross_check_input(summary: TraceSummary) -> CrossCheck:
    return CrossCheck(summary.path, summary.on_gpu, ledger_overlap(summary) if summary.on_gpu else None)


def hta_rows(traces: dict[int, CrossCheck], choice: HtaChoice = HtaChoice(), workers: int | None = None,
             progress: Callable[[str], None] = lambda _: None) -> tuple[list[Row], list[str]]:
    """Cross-check rows of the chosen ranks, and what was not checked and why (as `missing` sentences)."""
    gpu = {rank: t for rank, t in traces.items() if t.on_gpu}
    if not traces:
        return [], []
    if not gpu:
        return [], ["HTA cross-check skipped: traces have no GPU kernels (CPU run)"]
    if choice.which == "none":
        return [], ["HTA cross-check not run (--hta-ranks none)"]
    if not available():
        return [], ["HTA cross-check skipped: HolisticTraceAnalysis not installed (pip install 'train-ledger[hta]')"]
    chosen = choice.pick(sorted(gpu))
    missing = left_out("HTA cross-check", sorted(gpu), chosen, "traced GPU ranks", "--hta-ranks all checks every rank")
    rows = []
    count = worker_count(workers, len(chosen))
    if chosen:
        progress(f"HTA cross-check of rank(s) {ranks_text(chosen)}, {count} at a time")
    with ThreadPoolExecutor(count) as pool:
        outcomes = pool.map(lambda r: run_capped(r, gpu[r].path, choice.memory_mib, choice.seconds), chosen)
        for i, (rank, outcome) in enumerate(zip(chosen, outcomes), 1):
            progress(f"HTA cross-check of rank {rank} done ({i}/{len(chosen)})")
            if outcome.problem is not None:
                missing.append(f"HTA cross-check of rank {rank} stopped: {outcome.problem}")
                continue
            rows.append(row("overlap.hta_comm_comp_overlap", "rank", predicted=gpu[rank].ledger_overlap,
                            measured=outcome.overlap, unit="fraction", tolerance=HTA_TOL,
                            explanation="HTA get_comm_comp_overlap (measured) vs the ledger's own computation from "
                                        "the same trace (predicted column), both without the last ProfilerStep",
                            rank=rank, source="hta"))
    return rows, missing
