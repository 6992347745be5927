"""A calibration file (`train-ledger calibrate --out FILE`): the compute and bandwidth sweeps of a machine, made
without a training run, for the runs that made none (a Megatron-LM run; `reconcile --calibration FILE`).

JSON Lines: a header object with no "kind" ({"calibration": 1, "device", "made", "command", "shapes"}), then one
`compute`, `bandwidth` or `host` record a line in the run-directory contract's form (common/events.py,
docs/run_directory.md), so that the time model reads them as it reads a run's own sweeps. A line that is no JSON
object or a record with a field of the wrong type is an InputError naming the file and line.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.errors import InputError
from common.events import BandwidthRecord, ComputeRecord, HostRecord, parse_event
from common.typecheck import TypeMismatch

FORMAT = 1


@dataclass
class CalibrationFile:
    path: Path
    header: dict[str, Any] = field(default_factory=dict)
    compute: list[ComputeRecord] = field(default_factory=list)
    bandwidth: list[BandwidthRecord] = field(default_factory=list)
    host: list[HostRecord] = field(default_factory=list)  # the host sweep's, where calibrate ran one

    def describe(self) -> str:
        return (f"calibration {self.path.name} ({self.header.get('device', 'unknown device')}, "
                f"{self.header.get('made', 'date unknown')}: {len(self.compute)} compute, "
                f"{len(self.bandwidth)} bandwidth, {len(self.host)} host records)")


def read_calibration(path: str | Path) -> CalibrationFile:
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(path, f"cannot read the calibration file ({exc.__class__.__name__})") from None
    out = CalibrationFile(path)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise InputError(path, f"line {number}: not JSON") from None
        if not isinstance(obj, dict):
            raise InputError(path, f"line {number}: not a JSON object")
        if "kind" not in obj:
            out.header = obj
            continue
        try:
            record = parse_event(obj)
        except TypeMismatch as exc:
            raise InputError(path, f"line {number}: {exc}") from None
        if isinstance(record, ComputeRecord):
            out.compute.append(record)
        elif isinstance(record, BandwidthRecord):
            out.bandwidth.append(record)
        elif isinstance(record, HostRecord):
            out.host.append(record)
    if out.header.get("calibration") != FORMAT:
        raise InputError(path, f"no calibration header of format {FORMAT} (train-ledger calibrate writes one)")
    if not out.compute and not out.bandwidth:
        raise InputError(path, "no compute or bandwidth records")
    return out
