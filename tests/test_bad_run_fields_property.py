"""Every field of every kind of line in a real run directory (its events.jsonl records and its trace's events), set
to a value of the wrong type or range, or removed: `reconcile` answers one line naming the file with exit status 2,
or reconciles (a field it can do without); it never raises (a property-based test with hypothesis).

The kinds and fields are read off the recorded run, so a field a later probe writes is drawn without editing this
file. Each draw breaks that field in every line of its kind (the first line of a kind may be one the ledger skips).
A sweep of all of them (666 event and 535 trace cases, reconcile, report, whatif, export-trace and simulate
--validate) found four that raised: an inventory record without bytes, a per-element compute record without its
numel, a step window of no length and trace events whose order makes the replay's graph a cycle
(test_malformed_inputs.py states each); this test found a fifth, a thread id that is a list.
"""
from __future__ import annotations

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
SETTINGS = settings(max_examples=25, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


def _event_fields() -> list[tuple[str, str]]:
    lines = (RUN / EVENTS).read_text().splitlines()
    return sorted({(d["kind"], k) for d in map(json.loads, lines) for k in d if k != "kind"})


def _trace_fields() -> list[tuple[str, str]]:
    events = json.loads(gzip.decompress((RUN / TRACE).read_bytes()))["traceEvents"]
    return sorted({(e.get("cat", e.get("ph", "")), k) for e in events for k in e})


def _set(record: dict, field: str, value: Any) -> None:
    if value is REMOVED:
        record.pop(field, None)
    else:
        record[field] = value


def _reconciles_or_refuses(tmp_path: Path, broken: Path) -> None:
    out = tmp_path / "ledger"
    status, _, err = run(["reconcile", str(broken), "--out", str(out)])
    if status == 2:
        lines = err.strip().splitlines()
        assert len(lines) == 1 and str(broken) in lines[0], err
        assert not out.exists()
    else:
        assert status == 0, err


@pytest.mark.slow
@SETTINGS
@given(kind_field=st.sampled_from(_event_fields()), value=st.sampled_from(BAD))
def test_every_event_field_broken_is_reconciled_or_refused_by_name(tmp_path_factory, kind_field, value):
    kind, field = kind_field
    broken = tmp_path_factory.mktemp("run") / "run"
    shutil.copytree(RUN, broken)
    path = broken / EVENTS
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for record in records:
        if record["kind"] == kind:
            _set(record, field, value)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    _reconciles_or_refuses(broken.parent, broken)


@pytest.mark.slow
@SETTINGS
@given(cat_field=st.sampled_from(_trace_fields()), value=st.sampled_from(BAD))
def test_every_trace_event_field_broken_is_reconciled_or_refused_by_name(tmp_path_factory, cat_field, value):
    cat, field = cat_field
    broken = tmp_path_factory.mktemp("run") / "run"
    shutil.copytree(RUN, broken)
    path = broken / TRACE
    data = json.loads(gzip.decompress(path.read_bytes()))
    for e in data["traceEvents"]:
        if e.get("cat", e.get("ph", "")) == cat:
            _set(e, field, value)
    path.write_bytes(gzip.compress(json.dumps(data).encode(), compresslevel=1))
    _reconciles_or_refuses(broken.parent, broken)
