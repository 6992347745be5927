"""The run directory, contract v1: every reader and writer goes through this module (torch-free).

    RUN/manifest.json                      who ran what, where, with which versions, and whether it finished
    RUN/ranks/rank{R}/events.jsonl         append-only, one {"kind", "step", "t", ...} object a line
    RUN/traces/rank{R}.step{A}-{B}.json.gz torch.profiler Chrome traces
    RUN/tb/                                TensorBoard event files
    RUN/ledger/                            written by `train-ledger reconcile` / `report`

Crash safety: the manifest is replaced atomically and says "running" until the run ends; events are flushed at every
step end, so a killed rank leaves every completed step readable; a reader skips a torn last line and reports it, a
bad line anywhere else is corruption. Every field and kind: docs/run_directory.md.
"""
from __future__ import annotations

import contextlib
import datetime
import gzip
import json
import os
import re
import threading
import time
from pathlib import Path
from typing import IO, Any, Iterator, NamedTuple

from common.errors import InputError
from common.events import Event, parse_event
from common.typecheck import TypeMismatch

SCHEMA_VERSION = 1
MANIFEST = "manifest.json"
LEDGER_DIR = "ledger"  # RUN/ledger: what `reconcile` and `report` write, unless told to write elsewhere
STATUSES = ("running", "complete", "failed")
TRACE_RE = re.compile(r"^rank(\d+)\.step(\d+)-(\d+)\.json(\.gz)?$")


def rank_dir(run_dir: str | os.PathLike, rank: int) -> Path:
    return Path(run_dir) / "ranks" / f"rank{rank}"


def events_path(run_dir: str | os.PathLike, rank: int) -> Path:
    return rank_dir(run_dir, rank) / "events.jsonl"


def trace_path(run_dir: str | os.PathLike, rank: int, start: int, end: int) -> Path:
    return Path(run_dir) / "traces" / f"rank{rank}.step{start}-{end}.json.gz"


def check_writable(path: str | os.PathLike) -> Path:
    """`path` if a file can be written there, else InputError naming the path and the operating system's reason.
    Called before long work, so that a read-only run directory, a path under a file or a pseudo file system is
    refused at once rather than after minutes of merging or reconciling. The check leaves nothing behind: folders it
    had to create to try are removed again, so a command that fails later leaves no empty output folder."""
    path = Path(path)
    if path.is_dir():
        raise InputError(path, "is a directory; name a file")
    existing = next(p for p in path.parents if p.exists())
    if not existing.is_dir():
        raise InputError(path, f"cannot be written: {existing} is a file, not a folder (Not a directory)")
    created = [p for p in path.parents if not p.exists()]  # deepest first
    probe = path.with_name(f".{path.name}.probe{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        probe.open("w").close()
        probe.unlink()
    except OSError as exc:
        raise InputError(path, f"cannot be written ({exc.strerror or exc})") from None
    finally:
        for folder in created:
            with contextlib.suppress(OSError):
                folder.rmdir()
    return path


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, raw: bool = False) -> Iterator[IO[Any]]:
    """A text stream into a temp file beside `path` (gzip when the name ends in .gz), fsynced and renamed over `path`
    when the block ends cleanly and removed when it fails, so a reader never sees half a file and a failed write
    leaves whatever was there before. `raw`: a binary stream, written as it is (a caller that compresses itself)."""
    path = check_writable(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    opener = gzip.open if path.name.endswith(".gz") else open
    try:
        with (open(tmp, "wb") if raw else opener(tmp, "wt", encoding="utf-8")) as f:
            yield f
        with open(tmp, "rb") as written:
            os.fsync(written.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    with atomic_open(path) as f:
        f.write(text)


def now_iso() -> str:
    """The manifest's timestamps (started, ended): UTC, ISO 8601, milliseconds."""
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="milliseconds")


def write_manifest(run_dir: str | os.PathLike, manifest: dict[str, Any]) -> None:
    manifest = {"schema_version": SCHEMA_VERSION, **manifest}
    atomic_write_text(Path(run_dir) / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True) + "\n")


def update_manifest(run_dir: str | os.PathLike, **fields: Any) -> dict[str, Any]:
    manifest = read_manifest(run_dir)
    manifest.update(fields)
    write_manifest(run_dir, manifest)
    return manifest


def read_manifest(run_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(run_dir) / MANIFEST
    if not Path(run_dir).is_dir():
        raise InputError(run_dir, "not a directory")
    if not path.is_file():
        raise InputError(path, "missing manifest (not a run directory, or a run that never started)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InputError(path, f"corrupt JSON ({exc})") from None
    if not isinstance(manifest, dict):
        raise InputError(path, "manifest is not a JSON object")
    version = manifest.get("schema_version")
    if version != SCHEMA_VERSION:
        raise InputError(path, f"schema_version {version!r} is not supported (expected {SCHEMA_VERSION})")
    for key in ("run_id", "world_size", "status"):
        if key not in manifest:
            raise InputError(path, f"manifest lacks {key!r}")
    if manifest["status"] not in STATUSES:
        raise InputError(path, f"status {manifest['status']!r} is not one of {', '.join(STATUSES)}")
    return manifest


class EventWriter:
    """Append-only JSONL for one rank. `sync()` flushes and fsyncs; the engine calls it at every step end.

    The flush is what makes a SIGKILLed process lose nothing: the bytes are then the kernel's. The fsync only guards
    against the node itself going down, so `sync(wait=False)` flushes now and leaves the fsync to a background
    thread (at most one step behind), keeping a slow file system's fsync out of the step time.
    """

    def __init__(self, run_dir: str | os.PathLike, rank: int):
        self.path = events_path(run_dir, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")
        self._fsync_wanted = threading.Event()
        self._fsync_thread: threading.Thread | None = None
        self._closing = False

    def write(self, record: Event) -> None:
        """One typed record (common.events) as a v1 line, stamped with the wall time of the write."""
        line = {**record.to_json(), "t": time.time()}
        self._f.write(json.dumps(line, separators=(",", ":"), default=_jsonable) + "\n")

    def sync(self, wait: bool = True) -> None:
        self._f.flush()
        if wait:
            os.fsync(self._f.fileno())
            return
        if self._fsync_thread is None:
            self._fsync_thread = threading.Thread(target=self._fsync_loop, name="events-fsync", daemon=True)
            self._fsync_thread.start()
        self._fsync_wanted.set()

    def _fsync_loop(self) -> None:
        fd = self._f.fileno()
        while True:
            self._fsync_wanted.wait()
            self._fsync_wanted.clear()
            if self._closing:
                return
            os.fsync(fd)

    def close(self) -> None:
        if self._f.closed:
            return
        if self._fsync_thread is not None:
            self._closing = True
            self._fsync_wanted.set()
            self._fsync_thread.join()
        self.sync()
        self._f.close()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return str(value)


def ranks_present(run_dir: str | os.PathLike) -> list[int]:
    """The ranks that recorded events. An empty events.jsonl is a rank that recorded nothing, as a missing one is:
    the readers then say so (or refuse a run that claims to be complete), rather than reconcile the other ranks as
    if the world were smaller."""
    root = Path(run_dir) / "ranks"
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        m = re.fullmatch(r"rank(\d+)", child.name)
        events = child / "events.jsonl"
        if m and events.is_file() and events.stat().st_size > 0:
            found.append(int(m.group(1)))
    return sorted(found)


class EventStream:
    """Iterate one rank's events lazily as typed records (common.events); `torn_tail` tells afterwards whether the
    last line was cut off. A line of a known kind with a field of the wrong type is an InputError naming the file,
    the line and the field; a kind this version does not know is skipped (a later writer's)."""

    def __init__(self, run_dir: str | os.PathLike, rank: int, kinds: set[str] | None = None):
        self.path = events_path(run_dir, rank)
        self.kinds = kinds
        self.torn_tail = False

    def __iter__(self) -> Iterator[Event]:
        if not self.path.is_file():
            raise InputError(self.path, "missing events file")
        pending: tuple[int, str] | None = None
        with open(self.path, "rb") as f:
            for number, raw in enumerate(f, start=1):
                if pending is not None:  # a bad line followed by more lines is corruption, not a torn write
                    raise InputError(self.path, f"line {pending[0]}: {pending[1]}")
                obj, problem = _parse_line(raw)
                if problem:
                    pending = (number, problem)
                    continue
                if self.kinds is not None and obj["kind"] not in self.kinds:
                    continue
                try:
                    record = parse_event(obj)
                except TypeMismatch as exc:
                    raise InputError(self.path, f"line {number}: {exc}") from None
                if record is not None:
                    yield record
        if pending is not None:
            self.torn_tail = True


def _parse_line(raw: bytes) -> tuple[dict[str, Any] | None, str | None]:
    try:
        record = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        return None, f"corrupt JSON ({exc.__class__.__name__})"
    if not isinstance(record, dict) or not isinstance(record.get("kind"), str):
        return None, "not an event object with a 'kind'"
    return record, None


def iter_events(run_dir: str | os.PathLike, rank: int, kinds: set[str] | None = None) -> Iterator[Event]:
    return iter(EventStream(run_dir, rank, kinds))


class TraceFile(NamedTuple):
    """A rank's profiler trace and the steps its file name says it holds."""
    rank: int
    start: int
    end: int
    path: Path


def trace_files(run_dir: str | os.PathLike) -> list[TraceFile]:
    """Every trace in RUN/traces, sorted by rank then step."""
    root = Path(run_dir) / "traces"
    if not root.is_dir():
        return []
    out = []
    for child in root.iterdir():
        m = TRACE_RE.match(child.name)
        if m:
            out.append(TraceFile(int(m.group(1)), int(m.group(2)), int(m.group(3)), child))
    return sorted(out)
