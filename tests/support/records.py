"""Typed event records (common.events) from the plain dicts a test writes, checked as a reader checks them."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Callable, Iterable

from common.events import Event, event


def typed(kind: str, fields: Iterable[dict[str, Any]]) -> list[Event]:
    """One `kind` record per dict of fields (a dict may carry its own "step"; "kind" is ignored)."""
    return [event(kind, f.get("step"), **{k: v for k, v in f.items() if k not in ("kind", "step")}) for f in fields]


def rewrite_events(path: Path, edit: Callable[[dict[str, Any]], None]) -> None:
    """Each record of an events.jsonl file given to `edit`, which changes it in place, and the file written back."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for e in records:
        edit(e)
    path.write_text("".join(json.dumps(e) + "\n" for e in records))


def copy_without(run: Path, to: Path, drop: Callable[[dict[str, Any]], bool]) -> Path:
    """A copy of the run directory at `to` whose rank 0 events leave out the records `drop` picks: the run as it
    would read had it never recorded them."""
    shutil.copytree(run, to)
    events = to / "ranks" / "rank0" / "events.jsonl"
    events.write_text("".join(line for line in events.read_text().splitlines(keepends=True)
                              if not drop(json.loads(line))))
    return to


def copy_untraced(run: Path, to: Path) -> Path:
    """A copy of the run directory at `to` without its profiler traces: for claims about rows the traces do not
    feed (memory, the timers' time rows), which then skip parsing them (seconds a trace of a big run)."""
    return Path(shutil.copytree(run, to, ignore=shutil.ignore_patterns("traces")))


def stretch_range(e: dict[str, Any], factor: float) -> None:
    """A timing record's range taking `factor` times its measured time from the same start: every field that says
    when it ended moves together (duration_s, end_s, t_end)."""
    e["duration_s"] = (e["end_s"] - e["start_s"]) * factor
    e["end_s"] = e["start_s"] + e["duration_s"]
    e["t_end"] = e["t_start"] + e["duration_s"]
