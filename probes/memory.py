"""Device memory at named lifecycle points and per step (the seeds' probe_memory role), memory history, OOM dump.

The keys are torch.cuda.memory_stats() names, verbatim, so the ledger maps them 1:1 to Megatron's TensorBoard
keys (mem-reserved-bytes = reserved_bytes.all.current, mem-allocated-bytes = allocated_bytes.all.current,
mem-max-allocated-bytes = allocated_bytes.all.peak). Peaks are reset after each per-step read, so a step's peak is
that step's own.

Without CUDA there is no caching allocator to read: the record says device "cpu" and carries the process RSS and
its high-water mark instead, which is the only memory figure that means something there.
"""
from __future__ import annotations

import resource
from pathlib import Path
from typing import Any, Callable

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
