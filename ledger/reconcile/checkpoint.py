"""Checkpoint rows: each rank's file size against the formula, the save's blocking time, and where a run resumed.

From the probes' "checkpoint" events (engine.checkpointing, one per rank per save and per load):
- `checkpoint.bytes_per_rank`: the last save's file size on disk against ledger.formulas.checkpoint (param buffers,
  fp32 main params, Adam m, v and step, the CPU generator's state), judged with an absolute tolerance that is the
  zip container's and the pickle's overhead (that module says why). Every save of a run writes the same tensors,
  so one save per rank says it all.
- `checkpoint.save_seconds`: measured only (verdict n/a). A prediction would be the bytes over the file system's
  write bandwidth, which no probe measures, and a rank's save also waits in barriers for the slowest rank's write
  and for rank 0's rename. The whole save blocks the training loop (torch.save, nothing asynchronous), so there is
  no background part to report.
- `checkpoint.resumed_from_iteration` (run, identity): the iteration of the checkpoint this run loaded at start,
  as the engine reports it; shown, not judged.
"""
from __future__ import annotations

import os
from typing import Any

from ledger.formulas.checkpoint import checkpoint_bytes
from ledger.reconcile.evidence import RankEvidence, RunEvidence
from ledger.reconcile.rows import Row, identity_row, row

BYTES_TOLERANCE = 0.0  # relative: none; the absolute tolerance is the container's overhead


def _saves(r: RankEvidence) -> list[dict[str, Any]]:
    return [c for c in r.checkpoints if c.get("action") == "save"]


def bytes_row(ev: RunEvidence, r: RankEvidence, save: dict[str, Any]) -> Row:
    where = dict(rank=r.rank, stage=r.stage, step=save.get("iteration"), source="events")
    if ev.config is None:
        return row("checkpoint.bytes_per_rank", "rank", measured=save.get("bytes"), unit="bytes", tolerance=0.0,
                   explanation="this rank's checkpoint file on disk; no prediction: the manifest has no config",
                   **where)
    predicted = checkpoint_bytes(ev.config, r.coords.get("tp", 0), r.stage, r.coords.get("dp", 0))
    return row("checkpoint.bytes_per_rank", "rank", predicted=predicted.total, measured=save.get("bytes"),
               unit="bytes", tolerance=BYTES_TOLERANCE, abs_tolerance=predicted.container_tolerance,
               explanation=(f"this rank's checkpoint file on disk against its tensors (param buffers, fp32 main "
                            f"params, Adam m, v and step, RNG state: {predicted.tensors} tensors); torch.save's zip "
                            f"container and pickle add a few KB, allowed as up to "
                            f"{predicted.container_tolerance:,} bytes"), **where)


def seconds_row(r: RankEvidence, saves: list[dict[str, Any]]) -> Row:
    slowest = max(saves, key=lambda s: s.get("seconds") or 0.0)
    return row("checkpoint.save_seconds", "rank", measured=slowest.get("seconds"), unit="s", tolerance=0.0,
               rank=r.rank, stage=r.stage, step=slowest.get("iteration"), source="events",
               explanation=(f"the slowest of {len(saves)} save(s): the time the training loop waited (the whole save "
                            f"blocks: param sync, torch.save, barriers, rank 0's rename and pointer); this rank's "
                            f"torch.save alone took {slowest.get('write_seconds', 0.0):.3g} s; no prediction: it "
                            "would need the file system's write bandwidth, which no probe measures"))


def resumed_from(ev: RunEvidence) -> tuple[int, dict[str, Any]] | None:
    """(iteration, the load event) of the checkpoint the run loaded at start, from the first rank that says."""
    for _, r in sorted(ev.ranks.items()):
        for c in r.checkpoints:
            if c.get("action") == "load" and c.get("iteration") is not None:
                return int(c["iteration"]), c
    return None


def resumed_row(ev: RunEvidence) -> list[Row]:
    found = resumed_from(ev)
    if found is None:
        return []
    iteration, load = found
    what = ("took only its parameters (--finetune) and trained from iteration 0" if load.get("finetune")
            else "continued after it")
    directory = os.path.dirname(load.get("path") or "")
    return [identity_row("checkpoint.resumed_from_iteration", "run", measured=iteration, unit="count",
                         source="events", explanation=f"this run loaded the checkpoint of iteration {iteration} "
                                                      f"({directory}) at start and {what}")]


def checkpoint_rows(ev: RunEvidence) -> list[Row]:
    rows = resumed_row(ev)
    for _, r in sorted(ev.ranks.items()):
        saves = _saves(r)
        if saves:
            rows += [bytes_row(ev, r, saves[-1]), seconds_row(r, saves)]
    return rows
