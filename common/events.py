"""The run directory's event records, contract v1 in code: one typed record per kind of `events.jsonl` line.

The probes build these records and `common.run_dir.EventWriter` writes them; the ledger reads them back through
`parse_event`, which checks every field's type, so a wrong type names its file, line and field instead of failing
deep inside a row builder. A record keeps the fields it does not declare in `extra` (later writers may add some),
and `to_json()` writes exactly the v1 line, so a v1 run written before these types existed reads the same.
docs/run_directory.md describes each kind and field.
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar

from common.ops.rank import PER_ELEMENT
from common.typecheck import TypeMismatch, checked, optional

# Probe range categories and what each means (probes.nvtx_range gives each a colour).
RANGE_CATEGORIES = ("iteration", "forward", "backward", "optimizer", "dp-comm", "pp-comm", "tp-comm", "dp-wait",
                    "embd-comm", "checkpoint", "data-wait", "cp-comm", "cp-wait", "ep-comm", "mp-comm", "wgrad")
COMPUTE_CATEGORIES = ("forward", "backward")
STALL_CATEGORIES = ("dp-wait", "data-wait", "cp-wait")  # a stall: blocked time nested in compute ("wait ..." names)
# The group kind each communication category's collectives run on.
COMM_CATEGORY_GROUP = {"dp-comm": "dp", "tp-comm": "tp", "pp-comm": "pp", "embd-comm": "embedding", "cp-comm": "cp",
                       "mp-comm": "mp"}  # mp: the model-parallel group (tp x pp x cp) the grad norm is summed over

_CPU_FIGURES = ("rss_bytes", "peak_rss_bytes", "tensor_bytes", "tensor_storages", "held_tensor_bytes",
                "held_tensor_storages")
ALLOCATED = "allocated_bytes.all.current"
PEAK = "allocated_bytes.all.peak"
RESERVED = "reserved_bytes.all.current"


class RecordError(TypeMismatch):
    """A field of an event line has the wrong type or value (the reader adds the file and line)."""


def finite() -> Any:
    """A float field that must be finite (a NaN step time is a broken record, not a figure)."""
    return field(default=None, metadata={"finite": True})


AMOUNT_MAX = 2**63  # beyond any byte count, count or second a run can record (int64's range)


def amount() -> Any:
    """A duration, a size or a count: finite, never negative, never beyond AMOUNT_MAX."""
    return field(default=None, metadata={"finite": True, "minimum": 0, "maximum": AMOUNT_MAX})


@dataclass(slots=True)
class Event:
    KIND: ClassVar[str] = ""
    STEP_REQUIRED: ClassVar[bool] = False  # a record of this kind belongs to a step
    step: int | None = None
    t: float | None = None  # wall time of the write
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return self.KIND

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"kind": self.KIND}
        for f in dataclasses.fields(self):
            if f.name == "extra":
                continue
            value = getattr(self, f.name)
            if f.name == "stats":
                out.update(value)
            elif value is not None or f.name in ("step", "t"):
                out[f.name] = value
        out.update(self.extra)
        return out

    def check(self) -> None:
        """What a field's type cannot say (one field needed by another's value); RecordError names it."""

    def get(self, name: str, default: Any = None) -> Any:
        """A declared field or an extra one by name (the few readers that choose a field at run time)."""
        if name in self.extra:
            return self.extra[name]
        value = getattr(self, name, None) if name in _names(type(self)) else None
        return default if value is None else value


@dataclass(slots=True)
class MemoryRecord(Event):
    """memory_stats (CUDA) or RSS and a tensor census (CPU) at a lifecycle point, a step's end, an OOM or a failure."""
    KIND: ClassVar[str] = "memory"
    # after_model_build | after_ddp_buffers | after_optimizer_init | before_cuda_graphs | after_cuda_graphs |
    # after_first_step | step | oom | failure
    point: str | None = None
    device: str | None = None
    stats: dict[str, int] = field(default_factory=dict)  # torch.cuda.memory_stats keys
    rss_bytes: int | None = amount()
    peak_rss_bytes: int | None = amount()
    tensor_bytes: int | None = amount()
    tensor_storages: int | None = amount()
    held_tensor_bytes: int | None = amount()
    held_tensor_storages: int | None = amount()
    note: str | None = None

    @property
    def on_cuda(self) -> bool:
        return ALLOCATED in self.stats

    def figure(self, key: str) -> int | None:
        """A memory_stats key ("allocated_bytes.all.peak", "num_ooms", ...) or a CPU figure ("held_tensor_bytes")."""
        if key in self.stats:
            return self.stats[key]
        value = getattr(self, key, None) if key in _CPU_FIGURES else None
        return value if isinstance(value, int) else None

    @property
    def allocated(self) -> int | None:
        return self.stats.get(ALLOCATED)

    @property
    def peak(self) -> int | None:
        return self.stats.get(PEAK)

    @property
    def reserved(self) -> int | None:
        return self.stats.get(RESERVED)


@dataclass(slots=True)
class InventoryRecord(Event):
    """One tensor (or buffer) the engine allocated, and why."""
    KIND: ClassVar[str] = "inventory"
    name: str | None = None
    tensor_kind: str | None = None
    dtype: str | None = None
    numel: int | None = amount()
    bytes: int = amount()  # a tensor's size is what the inventory is for: required
    padding: int | None = amount()
    padding_bytes: int | None = amount()
    expert: bool | None = None
    buckets: list[dict[str, int]] | None = None
    allocated_at: str | None = None
    exists: bool | None = None


@dataclass(slots=True)
class TimingRecord(Event):
    """One timed probe range: seconds from the step's anchor (start_s, end_s) and wall times (t_start, t_end)."""
    KIND: ClassVar[str] = "timing"
    name: str = ""
    category: str = ""
    start_s: float = finite()
    end_s: float = finite()
    duration_s: float | None = amount()
    t_start: float | None = None
    t_end: float | None = None
    # time.perf_counter seconds from the step's anchor when the host opened and closed the range (probes/timers.py)
    host_start_s: float | None = None
    host_end_s: float | None = None
    clock: str | None = None
    stage: int | None = None
    microbatch: int | None = None
    chunk: int | None = None
    bucket: int | None = None
    bytes: int | None = amount()
    numel: int | None = amount()
    remote_bytes: int | None = amount()  # an all-to-all: the rows it sent to other EP ranks
    phase: str | None = None  # an all-to-all: dispatch or combine
    expert: bool | None = None  # a DP bucket of the expert buffers (reduced over the expert-data-parallel group)
    async_comm: bool | None = None
    issue_s: float | None = None  # an async collective: when it was issued, and when its wait returned
    wait_return_s: float | None = None

    @property
    def span(self) -> tuple[float, float]:
        return self.start_s, self.end_s


@dataclass(slots=True)
class NvmlRecord(Event):
    KIND: ClassVar[str] = "nvml"
    t_sample: float | None = None
    used_bytes: int | None = amount()
    total_bytes: int | None = amount()
    gpu_util_pct: float | None = None
    mem_util_pct: float | None = None
    power_w: float | None = None
    sm_clock_mhz: float | None = None
    # NVML's per-process accounting of the device (probes/nvml.py): the compute processes it lists, this process's
    # bytes and the other processes' (None where NVML does not list this process or gives no per-process bytes)
    processes: int | None = amount()
    own_bytes: int | None = amount()
    other_processes_bytes: int | None = amount()

    @property
    def used_without_others(self) -> int | None:
        """The device's used bytes less what other processes hold: this process's and the driver's."""
        if self.used_bytes is None:
            return None
        return self.used_bytes - (self.other_processes_bytes or 0)


@dataclass(slots=True)
class BandwidthRecord(Event):
    """One collective of the start-up bandwidth sweep at one size."""
    KIND: ClassVar[str] = "bandwidth"
    group: str = ""
    collective: str = ""
    group_size: int = amount()
    ranks: list[int] | None = None
    dtype: str | None = None
    numel: int | None = amount()
    size_bytes: int = amount()
    time_s: float = amount()
    algbw_GBps: float | None = None
    busbw_GBps: float | None = None
    iters: int | None = amount()
    backend: str | None = None


@dataclass(slots=True)
class ComputeRecord(Event):
    """One kernel of the start-up compute sweep, timed at the run's own shapes."""
    KIND: ClassVar[str] = "compute"
    op: str = ""
    dims: dict[str, int] = field(default_factory=dict)
    dtype: str | None = None
    seconds: float = amount()
    flops: float | None = None
    iters: int | None = amount()
    device: str | None = None
    threads: int | None = None
    variant: str | None = None
    cached: bool | None = None
    compute_bound_s: float | None = None
    memory_bound_s: float | None = None

    def check(self) -> None:
        if self.op in PER_ELEMENT and not self.dims.get("numel"):
            raise RecordError(f"compute record of {self.op!r} (priced per element) without a positive dims 'numel'")


@dataclass(slots=True)
class HostRecord(Event):
    """One primitive of the start-up host sweep (common/ops/host.py names them): the host's seconds per call on this
    CPU and torch, and under torch.profiler where the run profiles. A reader that predates the kind skips it
    (parse_event: None for an unknown kind); a later writer's fields land in `extra`."""
    KIND: ClassVar[str] = "host"
    op: str = ""
    seconds: float = finite()
    profiled_seconds: float | None = finite()  # the same call with torch.profiler recording (the run's settings)
    iters: int | None = None
    launches: bool | None = None  # the call launches device work (False: a CPU rank, ops on the calling thread)
    device: str | None = None
    cpu: str | None = None  # the host's CPU model
    torch: str | None = None  # torch.__version__
    threads: int | None = None
    note: str | None = None


@dataclass(slots=True)
class StepRecord(Event):
    """A step's figures; any other figure the engine passes lands in `extra`."""
    KIND: ClassVar[str] = "step"
    STEP_REQUIRED: ClassVar[bool] = True
    loss: float | None = None  # NaN allowed: a diverged step is a figure
    lr: float | None = None
    grad_norm: float | None = None
    tokens: int | None = amount()
    step_time_s: float | None = amount()
    tokens_per_s: float | None = amount()
    throughput: float | None = None
    profiled: bool | None = None  # this rank's profiler recorded the step
    after_trace_export: bool | None = None  # the step after the window's traces were written
    data_wait_s: float | None = amount()
    moe_tokens_per_expert: dict[str, Any] | None = None
    moe_dropped_tokens: dict[str, Any] | None = None
    moe_aux_loss: float | None = None
    # SequentialMLP: {"<global layer>": [[rows of each local expert] per counted forward]}, as its GEMMs ran them
    moe_expert_rows: dict[str, Any] | None = None


@dataclass(slots=True)
class CheckpointRecord(Event):
    """A checkpoint saved or loaded (between steps, so step None)."""
    KIND: ClassVar[str] = "checkpoint"
    action: str = ""  # save | load
    iteration: int | None = None
    path: str | None = None
    bytes: int | None = amount()
    blocking_seconds: float | None = amount()
    waited_for_previous_seconds: float | None = amount()
    host_alloc_seconds: float | None = amount()
    host_copy_seconds: float | None = amount()
    background_seconds: float | None = amount()
    write_seconds: float | None = amount()
    async_save: bool | None = None
    loaded_iteration: int | None = None
    finetune: bool | None = None
    seconds: float | None = amount()
    saved_by_run_dir: str | None = None


@dataclass(slots=True)
class RunEndRecord(Event):
    KIND: ClassVar[str] = "run_end"
    status: str | None = None
    error: str | None = None


RECORD_TYPES: dict[str, type[Event]] = {t.KIND: t for t in (
    MemoryRecord, InventoryRecord, TimingRecord, NvmlRecord, BandwidthRecord, ComputeRecord, HostRecord, StepRecord,
    CheckpointRecord, RunEndRecord)}
KINDS = tuple(RECORD_TYPES)


def event(kind: str, step: int | None, **fields: Any) -> Event:
    """A writer's typed record from its fields, checked as a reader would check them (a wrong type fails at the
    write, in the run that made it, not in a later reconcile)."""
    record = parse_event({"kind": kind, "step": step, **fields})
    if record is None:
        raise RecordError(f"unknown event kind {kind!r}")
    return record


def parse_event(obj: dict[str, Any]) -> Event | None:
    """A v1 line's object as its typed record; None for a kind this version does not know (a later writer's).
    RecordError names the first field of the wrong type."""
    kind = obj.get("kind")
    cls = RECORD_TYPES.get(kind)  # type: ignore[arg-type]
    if cls is None:
        return None
    declared = _fields(cls)
    values: dict[str, Any] = {}
    extra: dict[str, Any] = {}
    stats: dict[str, int] = {}
    for key, value in obj.items():
        if key == "kind":
            continue
        spec = declared.get(key)
        if spec is None:
            if cls is MemoryRecord and _is_stat(key):
                stats[key] = checked(f"{kind} record: field {key!r}", value, int, finite=True)
            else:
                extra[key] = value
            continue
        values[key] = checked(f"{kind} record: field {key!r}", value, spec.type, spec.finite, spec.minimum,
                              spec.maximum)
    missing = [name for name, spec in declared.items()
               if (spec.required or (name == "step" and cls.STEP_REQUIRED)) and values.get(name) is None]
    if missing:
        raise RecordError(f"{kind} record without {', '.join(repr(m) for m in missing)}")
    if cls is MemoryRecord:
        values["stats"] = stats
    record = cls(**values, extra=extra)
    record.check()
    return record


@dataclass(frozen=True)
class _Spec:
    type: Any
    finite: bool
    minimum: float | None
    maximum: float | None
    required: bool


_FIELD_CACHE: dict[type, dict[str, _Spec]] = {}


def _fields(cls: type[Event]) -> dict[str, _Spec]:
    if cls not in _FIELD_CACHE:
        hints = typing.get_type_hints(cls)
        _FIELD_CACHE[cls] = {
            f.name: _Spec(hints[f.name], bool(f.metadata.get("finite")), f.metadata.get("minimum"),
                          f.metadata.get("maximum"),
                          required=f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
                          or (f.metadata.get("finite") and not optional(hints[f.name])))
            for f in dataclasses.fields(cls) if f.name not in ("extra", "stats")}
    return _FIELD_CACHE[cls]


def _names(cls: type[Event]) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


def _is_stat(key: str) -> bool:
    """A torch.cuda.memory_stats key ("allocated_bytes.all.current", "num_ooms", ...)."""
    return "." in key or key.startswith("num_")
