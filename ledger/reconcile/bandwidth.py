"""Predicted collective time from the run's own bandwidth sweep (the `bandwidth` records of the start-up sweep).

The sweep (probes/bandwidth.py, nccl-tests conventions) measures algbw = size_bytes / time_s for each (collective,
group label "dp" / "tp" / "pp") at the run's own sizes; a collective of B bytes is predicted to take B / algbw at the
sweep size nearest to B on a log scale. Each rank predicts from its own sweep records. Using the nearest
measured point rather than a fitted alpha-beta model keeps the prediction explainable: "the sweep moved 64 MiB
reduce-scatters on the DP group at X GB/s".
"""
from __future__ import annotations

import math

from common.events import BandwidthRecord
from ledger.evidence.traces import normalize_op


def predicted_time(sweep: list[BandwidthRecord], op: str, group: str, nbytes: float) -> tuple[float, str] | None:
    """(seconds, how) for `nbytes` of `op` on `group`, or None when the sweep has no such point."""
    points = [s for s in sweep if normalize_op(s.collective) == op and s.group == group
              and s.size_bytes and s.time_s]
    if not points or nbytes <= 0:
        return None
    best = min(points, key=lambda s: abs(math.log(s.size_bytes) - math.log(nbytes)))
    algbw = best.size_bytes / best.time_s
    return nbytes / algbw, f"sweep: {op} on {group} at {best.size_bytes:,} B ran at {algbw / 1e9:.2f} GB/s algbw"
