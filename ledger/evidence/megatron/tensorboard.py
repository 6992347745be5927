"""Megatron-LM's own run directory, as Megatron-LM writes it with no wrapper (read from Megatron Core 0.18's
megatron/training: initialize.write_args_to_tensorboard, global_vars._set_tensorboard_writer, training.train and
training.training_log):

    RUN/
      <tensorboard dir>/       --tensorboard-dir, written by the last rank only (rank world_size - 1):
                               events.out.tfevents.<time>.<host>.<pid>.<n>, one file per launch (a resumed run adds
                               one), holding
                                 every argument of the parsed namespace as a text summary, at start-up:
                                   tag "<name>/text_summary", value str(getattr(args, name)), step = the iteration
                                   the launch starts from;
                                 scalars per iteration: mem-reserved-bytes, mem-allocated-bytes,
                                   mem-max-allocated-bytes, mem-allocated-count (--log-memory-to-tensorboard),
                                   iteration-time (--log-timers-to-tensorboard; not for a launch's first iteration),
                                   lm loss, learning-rate, ...
      torch_profile/rank-<R>.json.gz   --profile --use-pytorch-profiler: each profiled rank's Chrome trace, written
                               to --tensorboard-dir/../torch_profile (so beside the TensorBoard directory); its
                               ProfilerSteps are numbered like the iterations
      (older Megatron-LM wrote <host>_<pid>.<time>.pt.trace.json into the TensorBoard directory instead)

This module reads the files; megatron_arguments turns the arguments into our flags and ingest_megatron into
evidence. The records are checked and parsed with tensorboard's own CRC and protobuf classes (a declared dependency;
no torch).
"""
from __future__ import annotations

import re
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

from common.errors import InputError

EVENTS_GLOB = "events.out.tfevents.*"
TEXT_SUFFIX = "/text_summary"
PROFILE_DIR = "torch_profile"
PROFILE_RE = re.compile(r"^rank-(\d+)\.json(\.gz)?$")
HEADER = struct.Struct("<QI")  # a record's length and the masked CRC-32C of the length
FOOTER = struct.Struct("<I")  # the masked CRC-32C of the record


@dataclass
class EventFile:
    """One event file: one launch of Megatron-LM (one SummaryWriter)."""
    path: Path
    arguments: dict[str, str] = field(default_factory=dict)  # argument name -> str(value)
    arguments_step: int | None = None  # the iteration the launch started from
    scalars: dict[str, dict[int, float]] = field(default_factory=dict)  # tag -> {step: value}
    start: float | None = None  # wall time of the first event (s since the epoch)
    end: float | None = None
    torn_tail: bool = False  # the last record was cut short (the writer killed mid-write) and is skipped


def has_event_files(folder: Path) -> bool:
    return any(p.is_file() for p in folder.glob(EVENTS_GLOB))


def tensorboard_dirs(run_dir: Path) -> list[Path]:
    """The folders directly under run_dir that hold TensorBoard event files (Megatron writes them flat into
    --tensorboard-dir). One level only: a Megatron run folder also holds checkpoints, which are never walked."""
    try:
        children = sorted(c for c in run_dir.iterdir() if c.is_dir())
    except OSError as exc:
        raise InputError(run_dir, f"cannot list the run directory ({exc.strerror or exc})") from None
    return [c for c in children if has_event_files(c)]


def read_event_file(path: Path) -> EventFile:
    """Arguments (text summaries) and scalars of one event file; the last value of a tag at a step wins."""
    out = EventFile(path=path)
    try:
        for event in events(path, out):
            take(out, event)
    except OSError as exc:
        raise InputError(path, f"cannot read ({exc.strerror or exc})") from None
    return out


def take(out: EventFile, event: Any) -> None:
    out.start = event.wall_time if out.start is None else out.start
    out.end = event.wall_time
    for value in event.summary.value:
        if value.HasField("simple_value"):
            out.scalars.setdefault(value.tag, {})[event.step] = value.simple_value
        elif value.tag.endswith(TEXT_SUFFIX) and value.tensor.string_val:
            out.arguments[value.tag[:-len(TEXT_SUFFIX)]] = value.tensor.string_val[0].decode("utf-8", "replace")
            out.arguments_step = event.step


def events(path: Path, out: EventFile) -> Iterator[Any]:
    """The Event records of a file, each checked against its CRC. TFRecord framing: uint64 length, uint32 masked
    CRC-32C of the length, the serialized Event, uint32 masked CRC-32C of it. tensorboard's own loader stops quietly
    at the first bad record, which would pass a damaged file off as a short run: here damage is an InputError, and
    only a record cut short at the end (the writer killed mid-write) is tolerated, as `out.torn_tail`."""
    from google.protobuf.message import DecodeError
    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.tensorflow_stub.pywrap_tensorflow import (
        masked_crc32c,  # what tensorboard's writer uses
    )

    size = path.stat().st_size
    with open(path, "rb") as f:
        while head := f.read(HEADER.size):
            offset = f.tell() - len(head)
            if len(head) < HEADER.size:
                out.torn_tail = True
                return
            length, crc = HEADER.unpack(head)
            if masked_crc32c(head[:8]) != crc:
                raise InputError(path, f"corrupt TensorBoard event file (record header at byte {offset} fails its CRC)")
            if length + FOOTER.size > size - f.tell():
                out.torn_tail = True
                return
            data, (data_crc,) = f.read(length), FOOTER.unpack(f.read(FOOTER.size))
            if masked_crc32c(data) != data_crc:
                raise InputError(path, f"corrupt TensorBoard event file (record at byte {offset} fails its CRC)")
            try:
                event = Event.FromString(data)
            except DecodeError:
                raise InputError(path, f"corrupt TensorBoard event file (record at byte {offset} is no Event)") \
                    from None
            yield event


def read_event_files(tb_dir: Path) -> list[EventFile]:
    """Every event file of a TensorBoard directory, oldest launch first (by the first event's wall time)."""
    files = [read_event_file(p) for p in sorted(tb_dir.glob(EVENTS_GLOB)) if p.is_file()]
    return sorted(files, key=lambda f: (f.start is None, f.start or 0.0, f.path.name))


def merged_scalars(files: list[EventFile]) -> dict[str, dict[int, float]]:
    """tag -> {step: value} over launches in order: a resumed launch's value replaces the earlier one's at a step
    both logged (the steps after the checkpoint it resumed from)."""
    out: dict[str, dict[int, float]] = {}
    for f in files:
        for tag, values in f.scalars.items():
            out.setdefault(tag, {}).update(values)
    return out


def profile_traces(run_dir: Path) -> list[tuple[int, Path]]:
    """(rank, path) of each trace Megatron-LM exported to RUN/torch_profile/rank-<R>.json.gz, by rank."""
    folder = run_dir / PROFILE_DIR
    if not folder.is_dir():
        return []
    found = []
    for path in folder.iterdir():
        m = PROFILE_RE.match(path.name)
        if m and path.is_file():
            found.append((int(m.group(1)), path))
    return sorted(found)
