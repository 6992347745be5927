"""Every field of every kind of line in a real run directory (its events.jsonl records and its trace's events), set
to a value of the wrong type or range, or removed: `reconcile` answers one line naming the file with exit status 2,
or reconciles (a field it can do without); it never raises (a property-based test with hypothesis).

The kinds and fields are read off the recorded run, so a field a later probe writes is drawn without editing this
file. Each draw breaks that field in every line of its kind (the first line of a kind may be one the ledger skips).
A sweep (the 666 event cases through reconcile, whatif, export-trace and simulate --validate; part of the 535 trace
cases, within a time limit) found four that raised: an inventory record without bytes, a per-element compute record
without its numel, a step window of no length and trace events whose order makes the replay's graph a cycle
(test_malformed_inputs.py states each); this test found a fifth, a thread id that is a list.
"""
from __future__ import annotations

import functools
import gzip
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.cli import run

RUN = Path(__file__).parent / "fixtures" / "h200_2layer_profiled"  # events of every probe, and a profiled window
EVENTS = "ranks/rank0/events.jsonl"
TRACE = "traces/rank0.step4-5.json.gz"
REMOVED = object()
BAD: list[Any] = [None, "abc", -1, 1e308, [], {}, 0, REMOVED]
SETTINGS = settings(max_examples=50, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _kind(record: dict) -> str:
    """An events line's kind; a trace event's category (its phase where it has none)."""
    return record["kind"] if "kind" in record else record.get("cat", record.get("ph", ""))


def _events(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / EVENTS).read_text().splitlines()]


def _trace(run: Path) -> dict:
    return json.loads(gzip.decompress((run / TRACE).read_bytes()))


@functools.cache
def _fields() -> list[tuple[str, str, str]]:
    """(file, kind, field) of every field in the recorded run; read at the first draw, not when pytest collects."""
    return sorted({("events", _kind(d), k) for d in _events(RUN) for k in d if k != "kind"}
                  | {("trace", _kind(e), k) for e in _trace(RUN)["traceEvents"] for k in e})


def _break(run: Path, file: str, kind: str, field: str, value: Any) -> None:
    """Set `field` to `value` (or remove it) in every line of `kind` in the events or in the trace."""
    data = _events(run) if file == "events" else _trace(run)
    for record in data if file == "events" else data["traceEvents"]:
        if _kind(record) == kind:
            if value is REMOVED:
                record.pop(field, None)
            else:
                record[field] = value
    if file == "events":
        (run / EVENTS).write_text("".join(json.dumps(r) + "\n" for r in data))
    else:
        (run / TRACE).write_bytes(gzip.compress(json.dumps(data).encode(), compresslevel=1))


@pytest.mark.slow
@SETTINGS
@given(where=st.deferred(lambda: st.sampled_from(_fields())), value=st.sampled_from(BAD))
def test_every_field_broken_is_reconciled_or_refused_by_name(tmp_path_factory, where, value):
    broken = tmp_path_factory.mktemp("run") / "run"
    shutil.copytree(RUN, broken)
    _break(broken, *where, value)
    out = broken.parent / "ledger"
    hta = ["--hta-ranks", "none"] if where[0] == "events" else []  # the cross-check reads the trace alone
    status, _, err = run(["reconcile", str(broken), "--out", str(out), *hta])
    if status == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and str(broken) in lines[0], err
        assert not out.exists()
    else:
        assert status == 0, err
