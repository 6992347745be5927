"""What a run directory holds, gathered once per rank into small in-memory records the row builders share.

Events are streamed through common.run_dir (the one reader of the contract); only the records the rows use are
kept (memory points, per-step memory, inventory, timing, NVML, bandwidth, compute, step, checkpoint), which is a
few records per micro-batch per step. Timing records with no step are dropped: every row built from timings is per
step, and work outside the steps (start-up, the final forced param all-gather after the last step, a checkpoint's
save) belongs to none of them. Traces are not read here: they are summarised one file at a time by the modules that
need them.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

from common.config import RunConfig
from common.errors import InputError
from common.run_dir import EventStream, events_path, ranks_present, read_manifest, trace_files
from ledger.evidence.layout import Layout, coordinates

KEPT_KINDS = {"memory", "inventory", "timing", "nvml", "bandwidth", "compute", "step", "checkpoint"}


@dataclass
class RankEvidence:
    rank: int
    coords: dict[str, int]
    memory_points: dict[str, dict[str, Any]] = field(default_factory=dict)
    memory_steps: list[dict[str, Any]] = field(default_factory=list)
    inventory: list[dict[str, Any]] = field(default_factory=list)
    timing: list[dict[str, Any]] = field(default_factory=list)
    nvml: list[dict[str, Any]] = field(default_factory=list)
    bandwidth: list[dict[str, Any]] = field(default_factory=list)
    compute: list[dict[str, Any]] = field(default_factory=list)  # the compute sweep's kernel times (calibration)
    steps: list[dict[str, Any]] = field(default_factory=list)
    checkpoints: list[dict[str, Any]] = field(default_factory=list)  # saves and loads (engine.checkpointing)
    torn_tail: bool = False

    @property
    def stage(self) -> int:
        return self.coords.get("pp", 0)

    @property
    def on_cuda(self) -> bool:
        """Whether this rank's memory records come from the CUDA caching allocator (CPU runs carry RSS only)."""
        records = list(self.memory_points.values()) + self.memory_steps
        return any("allocated_bytes.all.current" in r for r in records)


@dataclass
class RunEvidence:
    run_dir: Path
    manifest: dict[str, Any]
    config: RunConfig | None
    ranks: dict[int, RankEvidence]
    traces: list[tuple[int, int, int, Path]]
    missing: list[str] = field(default_factory=list)
    framework: str = "train-ledger"

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])


T = TypeVar("T")


def after_first_step(items: list[T], step_of: Callable[[T], int]) -> list[T]:
    """The items of every step but the run's first, when there are others: the first step carries one-time work
    (allocator and cuBLAS warm-up, Adam state creation, compilation) and, under --overlap-param-gather, no param
    all-gather, so steady-state figures leave it out."""
    steps = {step_of(i) for i in items}
    if len(steps) < 2:
        return list(items)
    first = min(steps)
    return [i for i in items if step_of(i) != first]


def rank_entry(manifest: dict[str, Any], rank: int) -> dict[str, Any]:
    """A rank's entry in the manifest's `ranks` (a list, or a dict keyed by rank); {} when there is none."""
    entries = manifest.get("ranks")
    entry = None
    if isinstance(entries, dict):
        entry = entries.get(str(rank))
    elif isinstance(entries, list):
        entry = next((e for e in entries if isinstance(e, dict) and e.get("rank") == rank), None)
    return entry if isinstance(entry, dict) else {}


def rank_coords(manifest: dict[str, Any], rank: int) -> dict[str, int]:
    """A rank's (tp, cp, dp, pp) from the manifest, else derived from the run's parallel sizes."""
    coords = rank_entry(manifest, rank).get("coords")
    if isinstance(coords, dict):
        return {k: int(v) for k, v in coords.items()}
    return derived_coords(manifest, rank)


def rank_backend(manifest: dict[str, Any], rank: int, trace_backend: str | None) -> str | None:
    """The rank's process-group backend as the manifest records it, else as the trace's distributedInfo does
    (manifests written before the field existed); None when neither says."""
    backend = rank_entry(manifest, rank).get("backend")
    return str(backend) if backend else trace_backend


def cpu_sharing(manifest: dict[str, Any]) -> str | None:
    """A sentence when CPU ranks outnumber their host's cores (from the manifest's per-rank host and device): then
    every timed range includes time spent waiting for a core, which dominates timing gaps. None otherwise."""
    per_host: dict[str, list[dict[str, Any]]] = {}
    for rank in range(int(manifest.get("world_size") or 0)):
        entry = rank_entry(manifest, rank)
        device = entry.get("device") or {}
        if device.get("type") == "cpu" and entry.get("host"):
            per_host.setdefault(entry["host"], []).append(device)
    for host, devices in per_host.items():
        cores = devices[0].get("cores")
        if len(devices) > (cores or 1):
            where = f"{cores} cores" if cores else "its CPU (core count not recorded)"
            return (f"{len(devices)} ranks share host {host}'s {where}: process oversubscription; every timed range "
                    "includes waits for a core, and that, not the schedule or the network, dominates timed figures")
    return None


def derived_coords(manifest: dict[str, Any], rank: int) -> dict[str, int]:
    c = coordinates(Layout.from_manifest(manifest), rank)
    return {k: c[k] for k in ("tp", "cp", "dp", "pp")}


def load_config(manifest: dict[str, Any], manifest_path: Path) -> RunConfig:
    """The run's flags: every prediction is made from them, so a manifest without them cannot be reconciled (judged
    against a default layout, its rows would be off for no reason of the run's)."""
    raw = manifest.get("config")
    if raw is None:
        raise InputError(manifest_path, "manifest lacks 'config' (the run's flags, which every prediction needs)")
    try:
        return RunConfig.from_dict(raw)
    except (TypeError, KeyError) as exc:
        raise InputError(manifest_path, f"config does not match this version's RunConfig ({exc})") from None


def collect_rank(run_dir: Path, rank: int, coords: dict[str, int]) -> RankEvidence:
    ev = RankEvidence(rank=rank, coords=coords)
    stream = EventStream(run_dir, rank, KEPT_KINDS)
    for record in stream:
        _keep(ev, record, events_path(run_dir, rank))
    ev.torn_tail = stream.torn_tail
    return ev


def _keep(ev: RankEvidence, record: dict[str, Any], path: Path) -> None:
    kind = record["kind"]
    if kind == "memory":
        point = record.get("point")
        if point and point not in ev.memory_points:
            ev.memory_points[point] = record
        if point in (None, "step", "step_end"):
            ev.memory_steps.append(record)
    elif kind == "inventory":
        items = record.get("tensors") or record.get("records")
        ev.inventory.extend(items if isinstance(items, list) else [record])
    elif kind == "timing":
        if "start_s" not in record or "end_s" not in record:
            raise InputError(path, f"timing record without start_s/end_s: {record.get('name')!r}")
        if record.get("step") is not None:  # step-less: outside every step (start-up, the final param sync)
            ev.timing.append(record)
    else:
        attr = {"nvml": "nvml", "bandwidth": "bandwidth", "compute": "compute", "step": "steps",
                "checkpoint": "checkpoints"}[kind]
        getattr(ev, attr).append(record)


def collect_run(run_dir: str | Path) -> RunEvidence:
    """The whole run's evidence; a crashed or partial run yields what exists plus a list of what is missing."""
    run_dir = Path(run_dir)
    manifest = read_manifest(run_dir)
    manifest_path = run_dir / "manifest.json"
    world = manifest["world_size"]
    if not isinstance(world, int) or world < 1:
        raise InputError(manifest_path, f"world_size {world!r} is not a positive integer")
    config = load_config(manifest, manifest_path)
    if config is not None and config.parallel.world_size != world:
        raise InputError(manifest_path, f"world_size {world} contradicts config world size "
                                        f"{config.parallel.world_size}")
    present = ranks_present(run_dir)
    extra = [r for r in present if r >= world]
    if extra:
        raise InputError(run_dir / "ranks" / f"rank{extra[0]}", f"rank {extra[0]} is outside the manifest's world "
                                                               f"size {world} (mismatched world size)")
    traces = trace_files(run_dir)
    if not present and not traces:
        raise InputError(run_dir, "empty run: no ranks/rank*/events.jsonl and no traces")
    absent = [r for r in range(world) if r not in present]
    if manifest["status"] == "complete" and absent:
        raise InputError(run_dir / "ranks", f"missing ranks: the manifest says complete with world size {world} but "
                                            f"rank(s) {_span(absent)} wrote no events")
    ranks = {r: collect_rank(run_dir, r, rank_coords(manifest, r)) for r in present}
    ev = RunEvidence(run_dir=run_dir, manifest=manifest, config=config, ranks=ranks, traces=traces,
                     framework=manifest.get("framework", "train-ledger"))
    ev.missing = missing_items(ev)
    return ev


def missing_items(ev: RunEvidence) -> list[str]:
    """What a complete, fully probed run would have and this one lacks, one sentence each."""
    out = []
    status = ev.manifest.get("status")
    if status != "complete":
        error = ev.manifest.get("error")
        out.append(f"run status is {status!r}" + (f" ({error})" if error else "") + ": figures cover what was written")
    absent = [r for r in range(ev.world_size) if r not in ev.ranks]
    if absent:
        out.append(f"no events for rank(s) {_span(absent)} of {ev.world_size}")
    torn = [r for r, e in ev.ranks.items() if e.torn_tail]
    if torn:
        out.append(f"events of rank(s) {_span(torn)} end in a torn line (killed mid-write): last record skipped")
    for label, attr in (("timing records (--timers)", "timing"), ("step records", "steps"),
                        ("inventory", "inventory"), ("bandwidth sweep (--bandwidth-sweep)", "bandwidth")):
        if ev.ranks and not any(getattr(e, attr) for e in ev.ranks.values()):
            out.append(f"no {label}")
    if not ev.traces:
        out.append("no profiler traces (--use-pytorch-profiler)")
    return out


def _span(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks) if len(ranks) <= 8 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)})"
