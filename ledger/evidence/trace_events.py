"""The fields of a Chrome trace event that the trace summary (ledger.evidence.traces) and the execution graph
(ledger.evidence.exec_graph) read, as msgspec records.

A Kineto event carries dozens of fields and args (grid, registers per thread, Concrete Inputs, ...); declaring only
these makes the decoder skip the rest without building them, which is most of a trace's bytes. The args that vary
between Kineto versions and backends (a group's ranks as a list or a JSON string, counts as numbers or strings,
nested dims) are typed Any and read by the summary's own converters; the event's own fields are typed, with strings
coerced to numbers where a number belongs (decoding is not strict), so that a malformed event is refused by name.
A dispatcher op's input dims and types (nested lists on every CPU op) are kept as raw JSON and decoded only for the
few ops the summary reads them of: building them all would cost most of the decoding time.
"""
from __future__ import annotations

from typing import Any

import msgspec


class EventArgs(msgspec.Struct, gc=False):
    collective_name: Any = msgspec.field(default=None, name="Collective name")
    in_msg_nelems: Any = msgspec.field(default=None, name="In msg nelems")
    out_msg_nelems: Any = msgspec.field(default=None, name="Out msg nelems")
    dtype: Any = None
    group_ranks: Any = msgspec.field(default=None, name="Process Group Ranks")
    seq: Any = msgspec.field(default=None, name="Seq")
    correlation: Any = None  # CUPTI's id, shared by a runtime call and the GPU work it enqueued
    stream: Any = None
    input_dims_json: msgspec.Raw = msgspec.field(default=msgspec.Raw(), name="Input Dims")
    input_type_json: msgspec.Raw = msgspec.field(default=msgspec.Raw(), name="Input type")

    @property
    def input_dims(self) -> Any:
        return msgspec.json.decode(self.input_dims_json) if self.input_dims_json else None

    @property
    def input_type(self) -> Any:
        return msgspec.json.decode(self.input_type_json) if self.input_type_json else None


NO_ARGS = EventArgs()


class TraceEvent(msgspec.Struct, gc=False):
    ph: str | None = None
    cat: str | None = None
    name: str = ""
    tid: int | str | None = None  # a thread id, or a name ("stream 7") in some Kineto versions
    ts: float | None = None  # µs
    dur: float = 0.0
    args: EventArgs | None = None
    id: Any = None  # a flow event's id (ac2g: a launch's correlation)
