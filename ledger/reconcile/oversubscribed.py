"""Timings of CPU ranks that outnumber their host's cores are shown, not judged.

When a host runs more CPU ranks than it has cores (the CPU demo: 8 gloo ranks on a 2-core laptop), every timed range
holds the time its rank waited for a core, and the operating system's scheduler decides how long: a gloo collective
lasts until each of its peers has been scheduled, a pipeline stage idles until its neighbour runs. The time model
scales compute by the oversubscription (ledger.models.time_model.calibration.oversubscription), which prices the shared
cores but not the scheduler's order, so a gap between prediction and measurement there says nothing about the
schedule, the buckets or the network. The rows built from wall-clock time (TIMED_FAMILIES) keep their prediction
and measurement, the verdict of each becomes "n/a" with a short tag, and the reason is stated once for the whole run
(`set_aside`'s line, which reconcile puts in the reconciliation's `missing`). Memory, communication volume and
topology rows are not timings and stay judged.
"""
from __future__ import annotations

from ledger.reconcile.rows import Row

TIMED_FAMILIES = ("time", "pipeline", "overlap", "throughput", "step")
NOT_JUDGED = "not judged: CPU ranks outnumber their cores"


def is_timed(row: Row) -> bool:
    return row.metric.split(".", 1)[0] in TIMED_FAMILIES


def set_aside(rows: list[Row], sharing: str | None) -> str | None:
    """When `sharing` (evidence.cpu_sharing's sentence: which ranks share which cores) is set, make every timed row
    n/a and tag it; return the run's one line saying so, or None when the ranks had their cores."""
    if sharing is None:
        return None
    timed = [r for r in rows if is_timed(r)]
    judged = sum(r.verdict in ("ok", "warn", "off") for r in timed)
    for r in timed:
        if r.verdict != "identity":
            r.verdict = "n/a"
        r.explanation += f"; {NOT_JUDGED}"
    return (f"timings not judged: {sharing}; the {len(timed)} time, pipeline, overlap, throughput and step rows show "
            f"prediction and measurement with verdict n/a ({judged} would have been judged)")
