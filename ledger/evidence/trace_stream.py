"""A Chrome trace's events, read once in batches without holding the document.

The top-level object is walked key by key from a text buffer refilled in 4 MiB chunks; every top-level value but
"traceEvents" (distributedInfo, trainLedger, ...) is small and lands in `meta`, complete once iteration has ended
(Kineto writes some of them after the events). The "traceEvents" array is decoded a buffer at a time by msgspec:
the buffer is cut after its last event (a `}` followed by `,` and the next `{`, or by the closing `]`) and the
events up to there decoded in one call, either into plain dicts or into a typed record that declares only the fields
its reader uses (ledger.evidence.trace_events), whose other fields are skipped without being built. A cut guessed
inside a string cannot decode (the text would end inside that string), and neither can corrupt text: then the events
up to that cut are read one at a time by the standard library's decoder, which either finds the corruption and says
where (the InputError every caller relies on) or passes the bad guess, after which batches resume.

Memory: the buffer, one batch of decoded events and `meta`. A trace is gzip or plain JSON, told apart by its magic
bytes; corrupt gzip, a truncated file or a JSON document that is not a Chrome trace is an InputError naming the file.
"""
from __future__ import annotations

import gzip
import json
import zlib
from pathlib import Path
from typing import Any, Iterator

import msgspec

from common.errors import InputError

READ_CHARS = 4 << 20
MAX_EVENT_CHARS = 64 << 20  # one event larger than this is corruption, not a slow reader
CUT_TRIES = 8  # event-boundary guesses tried from the buffer's end before reading one event at a time
_DECODER = json.JSONDecoder()
_WHITESPACE = " \t\r\n"


class TraceStream:
    """Iterate a trace's events (plain dicts, or `event_type` records when given), or `batches()` of them."""

    def __init__(self, path: str | Path, event_type: type[msgspec.Struct] | None = None):
        self.path = Path(path)
        self.meta: dict[str, Any] = {}
        self.saw_events = False
        self.event_type = event_type
        self._decoder = msgspec.json.Decoder(list[event_type] if event_type else list, strict=False)

    def __iter__(self) -> Iterator[Any]:
        for batch in self.batches():
            yield from batch

    def batches(self) -> Iterator[list[Any]]:
        if not self.path.is_file():
            raise InputError(self.path, "missing trace file")
        try:
            with open_trace_text(self.path) as f:
                yield from self._walk(_Buffer(f, self.path))
        except (OSError, EOFError, zlib.error) as exc:
            raise InputError(self.path, f"corrupt or truncated gzip ({exc.__class__.__name__}: {exc})") from None
        except UnicodeDecodeError:
            raise InputError(self.path, "not UTF-8 JSON") from None
        if not self.saw_events:
            raise InputError(self.path, "not a Chrome trace (no traceEvents list)")

    def _walk(self, b: "_Buffer") -> Iterator[list[Any]]:
        b.expect("{")
        if b.peek() == "}":
            b.take()
        else:
            while True:
                key = b.value()
                b.expect(":")
                if key == "traceEvents" and b.peek() == "[":
                    self.saw_events = True
                    yield from self._events(b)
                else:
                    self.meta[str(key)] = b.value()
                ch = b.take()
                if ch == "}":
                    break
                if ch != ",":
                    b.fail("expected ',' or '}' between top-level keys")
        if b.peek() != "":
            b.fail("trailing data after the trace object")

    def _events(self, b: "_Buffer") -> Iterator[list[Any]]:
        b.expect("[")
        if b.peek() == "]":
            b.take()
            return
        slow_until = 0  # an offset in the file's text: read one event at a time until past it
        while True:
            batch = None
            if b.offset() >= slow_until:
                batch, slow_until = b.batch(self._decoder)
                if batch is not None and self.event_type is None:
                    batch = [e for e in batch if isinstance(e, dict)]  # a non-object is no event
            if batch is None:
                batch = self._one(b.value())
            if batch:
                yield batch
            ch = b.take()
            if ch == "]":
                return
            if ch != ",":
                b.fail("expected ',' or ']' in traceEvents")

    def _one(self, value: Any) -> list[Any]:
        """One event read by the standard library: a non-object is no event (skipped); an object that the typed
        record cannot hold (a string where a number belongs, args that are not an object) is refused by name."""
        if not isinstance(value, dict):
            return []
        if self.event_type is None:
            return [value]
        try:
            return msgspec.json.decode(b"[" + msgspec.json.encode(value) + b"]", type=self._decoder.type, strict=False)
        except msgspec.ValidationError as exc:
            raise InputError(self.path, f"not a Chrome trace event ({exc}): {json.dumps(value)[:200]}") from None


class _Buffer:
    def __init__(self, f: Any, path: Path):
        self.f, self.path, self.text, self.pos, self.eof = f, path, "", 0, False
        self.base = 0  # the file offset (in characters) of text[0]

    def fill(self) -> bool:
        chunk = self.f.read(READ_CHARS)
        if not chunk:
            self.eof = True
            return False
        self.base += self.pos
        self.text, self.pos = self.text[self.pos:] + chunk, 0
        return True

    def offset(self) -> int:
        return self.base + self.pos

    def peek(self) -> str:
        while True:
            while self.pos < len(self.text) and self.text[self.pos] in _WHITESPACE:
                self.pos += 1
            if self.pos < len(self.text) or not self.fill():
                return self.text[self.pos] if self.pos < len(self.text) else ""

    def take(self) -> str:
        ch = self.peek()
        self.pos += 1
        return ch

    def expect(self, ch: str) -> None:
        if self.take() != ch:
            self.fail(f"expected {ch!r}")

    def value(self) -> Any:
        self.peek()
        while True:
            try:
                obj, end = _DECODER.raw_decode(self.text, self.pos)
            except json.JSONDecodeError as exc:
                if len(self.text) - self.pos > MAX_EVENT_CHARS or not self.fill():
                    self.fail(exc.msg)
                continue
            if end == len(self.text) and not self.eof and self.fill():
                continue  # a number cut at the buffer's end decodes too early: decode again with more text
            self.pos = end
            return obj

    def batch(self, decoder: msgspec.json.Decoder) -> tuple[list[Any] | None, int]:
        """The whole events from here to the buffer's last event boundary, decoded in one call; else None and the
        file offset to read one event at a time up to (0 when no boundary was found: read one event)."""
        if len(self.text) - self.pos < READ_CHARS:
            self.fill()
        end = len(self.text)
        for _ in range(CUT_TRIES):
            cut = self._boundary(end)
            if cut < 0:
                return None, 0
            try:
                events = decoder.decode("[" + self.text[self.pos:cut] + "]")
            except msgspec.ValidationError:
                return None, self.base + cut  # JSON, but not events the record holds: read one at a time to say which
            except msgspec.DecodeError:
                end = cut - 1  # a guess inside a string (or corrupt text): try the boundary before it
                continue
            self.pos = cut
            return events, 0
        return None, self.base + end + 1

    def _boundary(self, end: int) -> int:
        """The position just after the last `}` before `end` that closes an event: followed by `,` and the next
        event's `{`, or by the array's `]`; -1 when there is none."""
        text = self.text
        while True:
            i = text.rfind("}", self.pos, end)
            if i < 0:
                return -1
            j = _skip(text, i + 1)
            if j < len(text) and text[j] == "]":
                return i + 1
            if j < len(text) and text[j] == ",":
                k = _skip(text, j + 1)
                if k < len(text) and text[k] == "{":
                    return i + 1
            end = i

    def fail(self, problem: str) -> None:
        where = "at end of file" if self.eof and self.pos >= len(self.text) else "mid-file"
        raise InputError(self.path, f"corrupt or truncated JSON ({problem}, {where})")


def _skip(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def open_trace_text(path: Path) -> Any:
    """A trace as text, gzip or plain by its magic bytes rather than its name."""
    with open(path, "rb") as f:
        magic = f.read(2)
    if magic == b"\x1f\x8b":
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")
