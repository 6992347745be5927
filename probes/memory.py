"""Device memory at named lifecycle points and per step, memory history, OOM dump.

The keys are torch.cuda.memory_stats() names, verbatim, so the ledger maps them 1:1 to Megatron's TensorBoard
keys (mem-reserved-bytes = reserved_bytes.all.current, mem-allocated-bytes = allocated_bytes.all.current,
mem-max-allocated-bytes = allocated_bytes.all.peak). Peaks are reset after each per-step read, so a step's peak is
that step's own.

Without CUDA there is no caching allocator to read: the record says device "cpu" and carries the process RSS and
its high-water mark, and at the named lifecycle points a census of tensor storages (`tensor_census`): those behind
the tensors the engine holds, which the static memory rows read as the CPU's allocated bytes, and those behind every
live tensor.
"""
from __future__ import annotations

import gc
import resource
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import torch

STAT_KEYS = (
    "reserved_bytes.all.current",
    "allocated_bytes.all.current",
    "allocated_bytes.all.peak",
    "active_bytes.all.peak",
    "num_alloc_retries",
    "num_ooms",
    "inactive_split_bytes.all.current",
)
HISTORY_MAX_ENTRIES = 100_000


def _rss_bytes() -> int:
    with open("/proc/self/statm", encoding="ascii") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def storage_bytes(tensors: Iterable[torch.Tensor]) -> tuple[int, int]:
    """(bytes, storages) of the CPU storages behind `tensors`, each storage once however many views share it: a
    parameter that is a view into a DDP buffer counts the whole buffer, padding included, and only once."""
    storages: dict[int, int] = {}
    for t in tensors:
        try:  # the collector sees every library's tensors: fake, meta or sparse ones have no CPU storage to count
            if t.device.type != "cpu" or t.layout != torch.strided:
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
        except (RuntimeError, NotImplementedError):
            continue
        if nbytes:
            storages[ptr] = max(nbytes, storages.get(ptr, 0))
    return sum(storages.values()), len(storages)


def live_tensors() -> Iterator[torch.Tensor]:
    """Every tensor object alive in this process (the garbage collector tracks them all)."""
    # type(), not isinstance(): isinstance reads __class__, which some module-level objects answer with a deprecation
    # warning (torch.distributed.reduce_op).
    return (obj for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))


def tensor_census(held: Callable[[], Iterable[torch.Tensor]] | None = None) -> dict[str, int]:
    """The CPU's measured memory at a lifecycle point: the storages behind the tensors the engine holds (`held`: its
    parameters, gradient buffers and optimizer state) and behind every tensor alive in the process, in bytes.

    Why a census of storages: it measures what exists, by the storages' own sizes, independently of the ledger's
    formula and of the engine's inventory (which declares numel x element size per record); cheaply (one pass over
    the collector's objects, ~0.1-0.2 s, at the four lifecycle points only); and alike on every machine. A parameter
    copied instead of viewed into its buffer, an fp32 copy that should not exist, Adam state that was never created
    or a padding the formula does not know shows up as a gap in the static rows (which read `held_tensor_bytes`);
    what is alive beyond the held tensors (the mock data's token table, the RoPE cache, the last micro-batch, or a
    leak) is `tensor_bytes - held_tensor_bytes`, reported beside them. The alternative, torch.profiler with
    profile_memory=True, sizes only blocks allocated while a profiler runs: it would have to record every op from
    before the model is built through step 1, and the profiler is one per process, which the steps' profiler window
    owns. Not seen by either census: tensors only C++ holds (autograd's saved activations inside a step, gloo's
    buffers) and malloc's slack; between steps, where the points are, the former do not exist.
    """
    live, storages = storage_bytes(live_tensors())
    record = {"tensor_bytes": live, "tensor_storages": storages}
    if held is not None:
        record["held_tensor_bytes"], record["held_tensor_storages"] = storage_bytes(held())
    return record


class MemoryProbe:
    def __init__(self, use_cuda: bool):
        self.use_cuda = use_cuda
        self.device = f"cuda:{torch.cuda.current_device()}" if use_cuda else "cpu"

    def read(self) -> dict[str, Any]:
        """The memory figures of this moment, as the fields of one `memory` record."""
        if not self.use_cuda:
            return {"device": "cpu", "rss_bytes": _rss_bytes(), "peak_rss_bytes": _peak_rss_bytes(),
                    "note": "no CUDA: process RSS only"}
        stats = torch.cuda.memory_stats()
        return {"device": self.device, **{k: stats.get(k, 0) for k in STAT_KEYS}}

    def read_point(self, held: Callable[[], Iterable[torch.Tensor]] | None = None) -> dict[str, Any]:
        """A lifecycle point's figures: on the CPU also the tensor census (too slow for every step, and the static
        rows need only the points); `held` lists the engine's own tensors, called only here."""
        if self.use_cuda:
            return self.read()
        return {**self.read(), **tensor_census(held), "note": "no CUDA: process RSS and a census of tensor storages"}

    def read_step(self) -> dict[str, Any]:
        """Read, then reset the peaks so that the next step's peak is its own."""
        figures = self.read()
        if self.use_cuda:
            torch.cuda.reset_peak_memory_stats()
        return figures


class MemoryHistory:
    """--record-memory-history: the allocator's event history with Python stacks, for PyTorch's memory viewer."""

    def __init__(self, use_cuda: bool, snapshot_path: Path):
        self.recording = use_cuda
        self.snapshot_path = snapshot_path
        if use_cuda:
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_MAX_ENTRIES, stacks="python")

    @property
    def note(self) -> str:
        return f"recording to {self.snapshot_path.name}" if self.recording else "off: no CUDA allocator to record"

    def dump(self) -> Path | None:
        if not self.recording:
            return None
        self.snapshot_path.parent.mkdir(parents=True, exist_ok=True)
        torch.cuda.memory._dump_snapshot(str(self.snapshot_path))
        return self.snapshot_path

    def stop(self) -> None:
        if self.recording:
            self.dump()
            torch.cuda.memory._record_memory_history(enabled=None)
            self.recording = False


def attach_oom_observer(on_oom: Callable[[dict[str, Any]], None]) -> bool:
    """Call on_oom(details) from inside the allocator when a CUDA allocation fails, before the error is raised.

    The caller is expected to write the failing rank's memory record, dump the history snapshot and flush: once the
    OutOfMemoryError propagates the process may die before any other handler runs. Returns whether it attached.
    """
    if not torch.cuda.is_available():
        return False

    def observer(device: int, alloc: int, device_allocated: int, device_free: int) -> None:
        on_oom({"oom_device": device, "oom_request_bytes": alloc, "oom_device_allocated_bytes": device_allocated,
                "oom_device_free_bytes": device_free})

    torch._C._cuda_attach_out_of_memory_observer(observer)
    return True
