"""Checkpoint rows: each rank's file size against the formula, the save's blocking and background time, and where a
run resumed.

From the probes' "checkpoint" events (engine.checkpointing, one per rank per save and per load):
- `checkpoint.bytes_per_rank`: the last save's file size on disk against ledger.models.formulas.checkpoint (param
buffers,
  fp32 main params, Adam m, v and step, the CPU generator's state), judged with an absolute tolerance that is the
  zip container's and the pickle's overhead (that module says why). Every save of a run writes the same tensors,
  so one save per rank says it all.
- `checkpoint.save_blocking_seconds`: the time the training loop waited for a save, the slowest save per rank.
  Without --async-save that is the whole save (param sync, torch.save, rank 0's wait for every rank's file, its
  rename and pointer); with it, the param sync, a barrier and the copy of the state into host memory, after
  waiting for the previous save's background part if that is still running.
- `checkpoint.save_background_seconds`: the time the background thread took under --async-save (this rank's
  torch.save of the host copy; on rank 0 also the wait for every rank's file and the rename), the slowest per rank;
  0 without --async-save (nothing runs in the background, which the explanation says).
  Both are measured only (verdict n/a): a prediction would be the bytes over the file system's write bandwidth,
  which no probe measures, and the copy's over the host link's.
- `checkpoint.resumed_from_iteration` (run, identity): the iteration of the checkpoint this run loaded at start, as
  the engine reports it, with the checkpoint's directory and the run directory that saved it; shown, not judged.
"""
from __future__ import annotations

import os

from common.events import CheckpointRecord
from ledger.evidence.run import RankEvidence, RunEvidence
from ledger.models.formulas.checkpoint import checkpoint_bytes
from ledger.reconcile.rows import Row, identity_row, row

BYTES_TOLERANCE = 0.0  # relative: none; the absolute tolerance is the container's overhead
NO_PREDICTION = "no prediction: it would need the file system's write bandwidth, which no probe measures"


def _saves(r: RankEvidence) -> list[CheckpointRecord]:
    return [c for c in r.checkpoints if c.action == "save"]


def bytes_row(ev: RunEvidence, r: RankEvidence, save: CheckpointRecord) -> Row:
    where = dict(rank=r.rank, stage=r.stage, step=save.iteration, source="events")
    if ev.config is None:
        return row("checkpoint.bytes_per_rank", "rank", measured=save.bytes, unit="bytes", tolerance=0.0,
                   explanation="this rank's checkpoint file on disk; no prediction: the manifest has no config",
                   **where)
    predicted = checkpoint_bytes(ev.config, r.coords.get("tp", 0), r.stage, r.coords.get("dp", 0))
    return row("checkpoint.bytes_per_rank", "rank", predicted=predicted.total, measured=save.bytes,
               unit="bytes", tolerance=BYTES_TOLERANCE, abs_tolerance=predicted.container_tolerance,
               explanation=(f"this rank's checkpoint file on disk against its tensors (param buffers, fp32 main "
                            f"params, Adam m, v and step, RNG state: {predicted.tensors} tensors); torch.save's zip "
                            f"container and pickle add a few KB, allowed as up to "
                            f"{predicted.container_tolerance:,} bytes"), **where)


def _blocking_seconds(save: CheckpointRecord) -> float | None:
    """Events written before --async-save existed name the blocking time (then the whole save) "seconds"."""
    return save.blocking_seconds if save.blocking_seconds is not None else save.seconds


def blocking_row(r: RankEvidence, saves: list[CheckpointRecord]) -> Row:
    slowest = max(saves, key=lambda s: _blocking_seconds(s) or 0.0)
    what = ("the param sync, a barrier and the copy of the state into host memory, after any wait for the previous "
            "save's background part (--async-save: the write runs in the background)" if slowest.async_save
            else "the whole save: param sync, torch.save, rank 0's wait for every rank's file, its rename and pointer")
    return row("checkpoint.save_blocking_seconds", "rank", measured=_blocking_seconds(slowest), unit="s",
               tolerance=0.0, rank=r.rank, stage=r.stage, step=slowest.iteration, source="events",
               explanation=(f"the slowest of {len(saves)} save(s): the time the training loop waited, {what}"
                            f"{_blocking_parts(slowest)}; {NO_PREDICTION}"))


def _blocking_parts(save: CheckpointRecord) -> str:
    """What the blocking time was spent on, where the event says (events before these fields: nothing)."""
    parts = [("waiting for the previous save's background part", save.waited_for_previous_seconds),
             ("pinning the host buffers", save.host_alloc_seconds),
             ("the device-to-host copy", save.host_copy_seconds)]
    shown = [f"{label} {seconds:.3g} s" for label, seconds in parts if seconds]
    return f" (of it: {', '.join(shown)})" if shown else ""


def background_row(r: RankEvidence, saves: list[CheckpointRecord]) -> Row:
    slowest = max(saves, key=lambda s: s.get("background_seconds") or 0.0)
    if not slowest.async_save:
        return row("checkpoint.save_background_seconds", "rank", measured=0.0, unit="s", tolerance=0.0,
                   rank=r.rank, stage=r.stage, step=slowest.iteration, source="events",
                   explanation="nothing ran in the background: without --async-save the whole save blocks (see "
                               "checkpoint.save_blocking_seconds)")
    on_rank_0 = "; on rank 0 also the wait for every rank's file, the rename and the pointer" if r.rank == 0 else ""
    return row("checkpoint.save_background_seconds", "rank", measured=slowest.background_seconds, unit="s",
               tolerance=0.0, rank=r.rank, stage=r.stage, step=slowest.iteration, source="events",
               explanation=(f"the slowest background part of {len(saves)} save(s) (--async-save), run while "
                            f"training went on: this rank's torch.save of the host copy "
                            f"({slowest.write_seconds or 0.0:.3g} s){on_rank_0}; {NO_PREDICTION}"))


def resumed_from(ev: RunEvidence) -> tuple[int, CheckpointRecord] | None:
    """(iteration, the load event) of the checkpoint the run loaded at start, from the first rank that says."""
    for _, r in sorted(ev.ranks.items()):
        for c in r.checkpoints:
            if c.action == "load" and c.iteration is not None:
                return int(c.iteration), c
    return None


def resumed_row(ev: RunEvidence) -> list[Row]:
    found = resumed_from(ev)
    if found is None:
        return []
    iteration, load = found
    what = ("took only its parameters (--finetune) and trained from iteration 0" if load.finetune
            else "continued after it")
    directory = os.path.dirname(load.path or "")
    saved_by = load.saved_by_run_dir
    by = f"saved by run {saved_by}" if saved_by else "saved by a run whose directory it does not record"
    return [identity_row("checkpoint.resumed_from_iteration", "run", measured=iteration, unit="count",
                         source="events", explanation=f"this run loaded {directory} ({by}) at start and {what}")]


def checkpoint_rows(ev: RunEvidence) -> list[Row]:
    rows = resumed_row(ev)
    for _, r in sorted(ev.ranks.items()):
        saves = _saves(r)
        if saves:
            rows += [bytes_row(ev, r, saves[-1]), blocking_row(r, saves), background_row(r, saves)]
    return rows
