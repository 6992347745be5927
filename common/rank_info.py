"""A rank's entry in the manifest's `ranks` (contract v1, docs/run_directory.md), typed: where it ran, its place in
the layout, the process groups it joined and what each probe did. The probes write it through `to_json`; readers
parse it with every field's type checked, so a wrong entry names the manifest and the field."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from common.typecheck import TypeMismatch, check_fields


@dataclass
class DeviceInfo:
    type: str = "unknown"  # cuda | cpu
    name: str | None = None
    index: int | None = None
    total_bytes: int | None = None
    cores: int | None = None  # CPU: the cores this process may run on


@dataclass
class RankInfo:
    rank: int
    host: str | None = None
    pid: int | None = None
    device: DeviceInfo = field(default_factory=DeviceInfo)
    backend: str | None = None
    coords: dict[str, int] | None = None
    groups: dict[str, list[int]] | None = None  # kind -> the global ranks this rank's group of that kind holds
    probes: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def parse(cls, obj: Any, where: str) -> "RankInfo":
        """TypeMismatch naming `where` and the field when `obj` is not a rank entry."""
        if not isinstance(obj, dict):
            raise TypeMismatch(f"{where} is {obj!r}, expected an object")
        device = obj.get("device") or {}
        if not isinstance(device, dict):
            raise TypeMismatch(f"{where}.device is {device!r}, expected an object")
        known = {f.name for f in dataclasses.fields(cls)}
        try:
            info = cls(**{k: v for k, v in obj.items() if k in known and k != "device"},
                       device=DeviceInfo(**{k: v for k, v in device.items()
                                            if k in {f.name for f in dataclasses.fields(DeviceInfo)}}))
        except TypeError as exc:  # a missing rank
            raise TypeMismatch(f"{where}: {exc}") from None
        check_fields(info, where)
        check_fields(info.device, f"{where}.device")
        return info


def parse_rank_infos(entries: Any) -> dict[int, RankInfo]:
    """The manifest's `ranks` (a list, or a dict keyed by rank) by rank; TypeMismatch for a wrong entry."""
    if entries is None:
        return {}
    items = entries.values() if isinstance(entries, dict) else entries
    if not isinstance(items, (list, type({}.values()))):
        raise TypeMismatch(f"ranks is {entries!r}, expected a list")
    infos = [RankInfo.parse(e, f"ranks[{i}]") for i, e in enumerate(items)]
    return {info.rank: info for info in infos}
