"""The trace reader (ledger.evidence.trace_stream): events decoded a buffer at a time must be exactly the events
json.load sees, wherever the buffer ends, whatever the events' strings hold; corruption is still found and named.
The buffer is shrunk to a few hundred characters here so that one small synthetic trace crosses hundreds of them."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.errors import InputError
from ledger.evidence import trace_stream
from ledger.evidence.trace_events import TraceEvent
from ledger.evidence.trace_stream import TraceStream
from ledger.evidence.traces import summarize

# strings that look like an event boundary ("}, {") or the array's end ("}]"), as Kineto may write in names and args
TRICKY = ['}, {', '},{"ph": "X"}', '}]', '\\"}, {\\"', 'plain']


@pytest.fixture
def small_buffer(monkeypatch):
    monkeypatch.setattr(trace_stream, "READ_CHARS", 300)


def kernels(n: int) -> list[dict]:
    return [{"ph": "X", "cat": "kernel", "name": f"k{i} {TRICKY[i % len(TRICKY)]}", "ts": 1000.5 + 10 * i,
             "dur": 4, "pid": 0, "tid": 7, "args": {"note": TRICKY[(i + 1) % len(TRICKY)], "nested": {"a": [1, {}]}}}
            for i in range(n)]


def write(path: Path, doc: dict, indent: int | None = None) -> Path:
    path.write_text(json.dumps(doc, indent=indent))
    return path


@pytest.mark.parametrize("indent", [None, 1])
def test_batches_are_the_events_json_load_sees(tmp_path, small_buffer, indent):
    events = kernels(500)
    doc = {"schemaVersion": 1, "traceEvents": events, "distributedInfo": {"rank": 0}, "trainLedger": {"run_id": "r"}}
    stream = TraceStream(write(tmp_path / "t.json", doc, indent))
    batches = list(stream.batches())
    assert [e for b in batches for e in b] == events
    assert len(batches) > 20  # many buffers, not one event at a time and not one batch
    assert stream.meta == {"schemaVersion": 1, "distributedInfo": {"rank": 0}, "trainLedger": {"run_id": "r"}}
    typed = list(TraceStream(tmp_path / "t.json", TraceEvent))
    assert [(e.name, e.ts, e.dur) for e in typed] == [(e["name"], e["ts"], e["dur"]) for e in events]


def test_the_summary_does_not_depend_on_the_buffer_size(tmp_path, monkeypatch):
    path = write(tmp_path / "t.json", {"traceEvents": kernels(400)})
    whole = summarize(path)
    monkeypatch.setattr(trace_stream, "READ_CHARS", 300)
    assert summarize(path) == whole and len(whole.compute) == 400


def test_corruption_mid_file_is_found_and_named(tmp_path, small_buffer):
    text = json.dumps({"traceEvents": kernels(200)})
    cut = text.index('"k150')
    path = tmp_path / "t.json"
    path.write_text(text[:cut] + '"k150" "oops", ' + text[cut + 5:])
    with pytest.raises(InputError, match=r"t\.json: corrupt or truncated JSON \(.*, mid-file\)"):
        list(TraceStream(path))


def test_an_event_the_record_cannot_hold_is_refused_by_name(tmp_path, small_buffer):
    events = kernels(50)
    events[30]["ts"] = [1, 2]
    path = write(tmp_path / "t.json", {"traceEvents": events})
    assert len(list(TraceStream(path))) == 50  # as plain dicts, anything goes
    with pytest.raises(InputError, match=r"not a Chrome trace event \(Expected `float \| null`, got `array`"):
        list(TraceStream(path, TraceEvent))


def test_elements_that_are_not_objects_are_no_events(tmp_path, small_buffer):
    events = kernels(40)
    path = write(tmp_path / "t.json", {"traceEvents": events[:20] + [7, None, "x"] + events[20:]})
    assert list(TraceStream(path)) == events
    assert len(list(TraceStream(path, TraceEvent))) == 40


def test_numbers_written_as_strings_are_read_as_numbers(tmp_path):
    path = write(tmp_path / "t.json", {"traceEvents": [{"ph": "X", "cat": "kernel", "name": "k", "ts": "12.5",
                                                        "dur": "2"}]})
    (e,) = TraceStream(path, TraceEvent)
    assert (e.ts, e.dur) == (12.5, 2.0)
