"""A run directory read once into typed evidence: the config, the layout, each rank's records, the trace files.

Every consumer (reconcile, report, the dashboard's loaders, what-if, `simulate --validate`, export-trace) takes a
RunEvidence; none re-reads the run. The manifest's config becomes a RunConfig here and nowhere else, and the layout
(parallel sizes, Megatron's rank arithmetic) is derived from it once. Events are streamed through common.run_dir and
parsed into common.events' typed records; only the kinds the ledger uses are kept, a few records per micro-batch per
step. Timing records with no step are dropped: every row built from timings is per step, and work outside the steps
(start-up, the final param all-gather, a checkpoint's save) belongs to none. Traces are summarised on first use
(`trace_summaries`), once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TypeVar

from common.config import RunConfig, validate
from common.errors import ConfigError, InputError
from common.events import (
    BandwidthRecord,
    CheckpointRecord,
    ComputeRecord,
    Event,
    HostRecord,
    InventoryRecord,
    MemoryRecord,
    NvmlRecord,
    StepRecord,
    TimingRecord,
)
from common.rank_info import DeviceInfo, RankInfo, parse_rank_infos
from common.run_dir import (
    MANIFEST,
    EventStream,
    TraceFile,
    ranks_present,
    read_manifest,
    trace_files,
)
from common.typecheck import TypeMismatch
from ledger.evidence.layout import GROUP_KINDS, Layout, coordinates, group_lists
from ledger.evidence.memory_snapshot import PeakSplit
from ledger.evidence.trace_pool import read_trace_summaries
from ledger.evidence.traces import TraceSummary

KEPT_KINDS = {"memory", "inventory", "timing", "nvml", "bandwidth", "compute", "host", "step", "checkpoint"}


@dataclass
class RankEvidence:
    rank: int
    coords: dict[str, int]
    memory_points: dict[str, MemoryRecord] = field(default_factory=dict)  # the first record of each named point
    memory_steps: list[MemoryRecord] = field(default_factory=list)
    inventory: list[InventoryRecord] = field(default_factory=list)
    timing: list[TimingRecord] = field(default_factory=list)
    nvml: list[NvmlRecord] = field(default_factory=list)
    bandwidth: list[BandwidthRecord] = field(default_factory=list)
    compute: list[ComputeRecord] = field(default_factory=list)  # the compute sweep's kernel times (calibration)
    host: list[HostRecord] = field(default_factory=list)  # the host sweep's cost per kind of call (calibration)
    steps: list[StepRecord] = field(default_factory=list)
    checkpoints: list[CheckpointRecord] = field(default_factory=list)  # saves and loads (engine.checkpointing)
    memory_snapshot: PeakSplit | None = None  # a Megatron-LM run's --record-memory-history snapshot, at its peak
    torn_tail: bool = False

    @property
    def stage(self) -> int:
        return self.coords.get("pp", 0)

    @property
    def on_cuda(self) -> bool:
        """Whether this rank's memory records come from the CUDA caching allocator (CPU runs carry RSS only)."""
        return any(r.on_cuda for r in [*self.memory_points.values(), *self.memory_steps])

    def keep(self, record: Event) -> None:
        if isinstance(record, MemoryRecord):
            if record.point and record.point not in self.memory_points:
                self.memory_points[record.point] = record
            if record.point in (None, "step", "step_end"):
                self.memory_steps.append(record)
        elif isinstance(record, TimingRecord):
            if record.step is not None:  # step-less: outside every step (start-up, the final param sync)
                self.timing.append(record)
        else:
            getattr(self, _LISTS[type(record)]).append(record)


_LISTS: dict[type, str] = {InventoryRecord: "inventory", NvmlRecord: "nvml", BandwidthRecord: "bandwidth",
                           ComputeRecord: "compute", HostRecord: "host", StepRecord: "steps",
                           CheckpointRecord: "checkpoints"}


@dataclass
class RunEvidence:
    run_dir: Path
    manifest: dict[str, Any]  # identity, status, per-rank entries, versions (the config is `config`)
    config: RunConfig | None
    ranks: dict[int, RankEvidence]
    traces: list[TraceFile]
    missing: list[str] = field(default_factory=list)
    framework: str = "train-ledger"
    layout: Layout | None = None
    rank_infos: dict[int, RankInfo] = field(default_factory=dict)  # the manifest's per-rank entries
    _summaries: dict[int, TraceSummary] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.layout is None and self.config is not None:
            self.layout = layout_of(self.config)

    @property
    def world_size(self) -> int:
        return int(self.manifest["world_size"])

    @property
    def run_id(self) -> str | None:
        return self.manifest.get("run_id")

    def coords(self, rank: int) -> dict[str, int]:
        """A rank's (tp, cp, dp, pp) as the manifest records them, each axis it does not record derived from the
        layout ({} for what neither gives)."""
        derived = {}
        if self.layout is not None:
            c = coordinates(self.layout, rank)
            derived = {k: c[k] for k in ("tp", "cp", "dp", "pp")}
        info = self.rank_infos.get(rank)
        return {**derived, **(info.coords if info is not None and info.coords is not None else {})}

    def groups(self, rank: int) -> dict[str, tuple[int, ...]]:
        """The rank's TP, DP and PP groups and, on the first and last stage, its embedding group (sorted rank
        tuples), from the ledger's own derivation of the layout; {} for a run without a config."""
        if self.layout is None:
            return {}
        lists = group_lists(self.layout)
        return {kind: tuple(sorted(g)) for kind in GROUP_KINDS for g in lists[kind] if rank in g}

    def backend(self, rank: int, trace_backend: str | None) -> str | None:
        """The rank's process-group backend as the manifest records it, else as the trace's distributedInfo does
        (manifests written before the field existed); None when neither says."""
        info = self.rank_infos.get(rank)
        return info.backend if info is not None and info.backend else trace_backend

    def device(self, rank: int) -> DeviceInfo | None:
        info = self.rank_infos.get(rank)
        return info.device if info is not None else None

    def runs_on_cuda(self, rank: int) -> bool:
        """Whether the manifest says this rank ran on a CUDA device."""
        device = self.device(rank)
        return device is not None and device.type == "cuda"

    def device_types(self) -> set[str | None]:
        """The kinds of device the ranks ran on ("cuda", "cpu"; None for a rank the manifest does not describe)."""
        return {d.type if d is not None else None for d in map(self.device, range(self.world_size))}

    def host(self, rank: int) -> str | None:
        info = self.rank_infos.get(rank)
        return info.host if info is not None else None

    def rank_evidence(self, rank: int) -> RankEvidence:
        """The rank's records, or an empty record set for a rank that wrote none (a traced rank without events)."""
        return self.ranks.get(rank) or RankEvidence(rank=rank, coords=self.coords(rank))

    def trace_summaries(self, workers: int | None = None,
                        progress: Callable[[str], None] = lambda _: None) -> dict[int, TraceSummary]:
        """Each traced rank's summary, every trace read once (on first call; in worker processes, see
        ledger.evidence.trace_pool) and checked to belong to this run."""
        if self._summaries is None:
            read = read_trace_summaries([(t.rank, t.path) for t in self.traces], workers, progress)
            self._summaries = {t.rank: self.checked(read[t.path], t) for t in self.traces}
        return self._summaries

    def checked(self, summary: TraceSummary, trace: TraceFile) -> TraceSummary:
        """The summary, if its trace belongs to this run: run id (written by our probes), rank, world size."""
        if summary.run_id is not None and summary.run_id != self.run_id:
            raise InputError(trace.path, f"trace from another run: run_id {summary.run_id!r}, manifest says "
                                         f"{self.run_id!r}")
        if summary.rank is not None and summary.rank != trace.rank:
            raise InputError(trace.path, f"distributedInfo says rank {summary.rank}, the file name rank {trace.rank}")
        if summary.world_size is not None and summary.world_size != self.world_size:
            raise InputError(trace.path, f"trace from another run: world size {summary.world_size}, this run's is "
                                         f"{self.world_size}")
        return summary


def layout_of(config: RunConfig) -> Layout:
    p = config.parallel
    return Layout.of(p.world_size, tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                     cp=p.context_parallel_size or 1, order=p.order,
                     vpp=p.virtual_pipeline_model_parallel_size or 1)


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


def cpu_sharing(ev: RunEvidence) -> str | None:
    """A sentence when CPU ranks outnumber their host's cores (from the manifest's per-rank host and device): then
    every timed range includes time spent waiting for a core, which dominates timing gaps. None otherwise."""
    per_host: dict[str, list[DeviceInfo]] = {}
    for info in ev.rank_infos.values():
        if info.device.type == "cpu" and info.host:
            per_host.setdefault(info.host, []).append(info.device)
    for host, devices in per_host.items():
        cores = devices[0].cores
        if len(devices) > (cores or 1):
            where = f"{cores} cores" if cores else "its CPU (core count not recorded)"
            return (f"{len(devices)} ranks share host {host}'s {where}: process oversubscription; every timed range "
                    "includes waits for a core, and that, not the schedule or the network, dominates timed figures")
    return None


def load_config(manifest: dict[str, Any], manifest_path: Path) -> RunConfig:
    """The run's flags, checked (the one place a run's config is read): every prediction is made from them, so a
    manifest without them cannot be reconciled (judged against a default layout, its rows would be off for no
    reason of the run's)."""
    raw = manifest.get("config")
    if raw is None:
        raise InputError(manifest_path, "manifest lacks 'config' (the run's flags, which every prediction needs)")
    if not isinstance(raw, dict):
        raise InputError(manifest_path, f"config is a {type(raw).__name__}, expected an object")
    try:
        config = RunConfig.from_dict(raw)
        validate(config)
        layout_of(config)
    except ConfigError as exc:
        raise InputError(manifest_path, f"config: {exc}") from None
    except (TypeError, KeyError, ValueError, AttributeError) as exc:
        raise InputError(manifest_path, f"config does not match this version's RunConfig ({exc})") from None
    return config


def collect_rank(run_dir: Path, rank: int, coords: dict[str, int]) -> RankEvidence:
    ev = RankEvidence(rank=rank, coords=coords)
    stream = EventStream(run_dir, rank, KEPT_KINDS)
    for record in stream:
        ev.keep(record)
    ev.torn_tail = stream.torn_tail
    return ev


def collect_run(run_dir: str | Path, manifest: dict[str, Any] | None = None) -> RunEvidence:
    """The whole run's evidence; a crashed or partial run yields what exists plus a list of what is missing.
    `manifest`: the run's manifest when the caller has read it already (read_manifest's checks passed)."""
    run_dir = Path(run_dir)
    manifest = manifest if manifest is not None else read_manifest(run_dir)
    manifest_path = run_dir / MANIFEST
    world = manifest["world_size"]
    if not isinstance(world, int) or isinstance(world, bool) or world < 1:
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
                                            f"rank(s) {span(absent)} wrote no events")
    try:
        rank_infos = parse_rank_infos(manifest.get("ranks"))
    except TypeMismatch as exc:
        raise InputError(manifest_path, str(exc)) from None
    ev = RunEvidence(run_dir=run_dir, manifest=manifest, config=config, ranks={}, traces=traces,
                     framework=manifest.get("framework", "train-ledger"), rank_infos=rank_infos)
    ev.ranks = {r: collect_rank(run_dir, r, ev.coords(r)) for r in present}
    ev.missing = missing_items(ev)
    return ev


def missing_items(ev: RunEvidence, our_probes: bool = True) -> list[str]:
    """What a complete, fully probed run would have and this one lacks, one sentence each; `our_probes` False (a
    Megatron-LM run, which has none of them) leaves out the records only this project's probes write."""
    out = []
    status = ev.manifest.get("status")
    if status != "complete":
        error = ev.manifest.get("error")
        out.append(f"run status is {status!r}" + (f" ({error})" if error else "") + ": figures cover what was written")
    absent = [r for r in range(ev.world_size) if r not in ev.ranks]
    if absent:
        out.append(f"no events for rank(s) {span(absent)} of {ev.world_size}")
    silent = [r for r, e in ev.ranks.items() if not _recorded_anything(e)]
    if silent:
        out.append(f"rank(s) {span(silent)} recorded no events (an empty events.jsonl)")
    torn = [r for r, e in ev.ranks.items() if e.torn_tail]
    if torn:
        out.append(f"events of rank(s) {span(torn)} end in a torn line (killed mid-write): last record skipped")
    if ev.config is None:
        out.append("manifest has no config: no predictions, and no rank groups to check or to name collectives by")
    for label, attr, ours in (("timing records (--timers)", "timing", True), ("step records", "steps", False),
                              ("inventory", "inventory", True),
                              ("bandwidth sweep (--bandwidth-sweep)", "bandwidth", True)):
        if (our_probes or not ours) and ev.ranks and not any(getattr(e, attr) for e in ev.ranks.values()):
            out.append(f"no {label}")
    if not ev.traces:
        out.append("no profiler traces (--use-pytorch-profiler)")
    return out


def _recorded_anything(r: RankEvidence) -> bool:
    return bool(r.memory_points or r.memory_steps or r.inventory or r.timing or r.nvml or r.bandwidth or r.compute
                or r.steps or r.checkpoints)


def span(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks) if len(ranks) <= 8 else f"{ranks[0]}..{ranks[-1]} ({len(ranks)})"
