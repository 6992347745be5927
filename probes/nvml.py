"""A per-rank NVML sampler thread: device used memory, utilisation, power and SM clock every --nvml-interval s.

NVML sees the whole device (CUDA context, NCCL buffers, other processes), which is what the ledger compares against
memory_stats' reserved bytes; each sample also splits it by process (NVML's per-process accounting, matched by pid),
so that what another process holds on the same GPU (a notebook, a second job, a bench harness) is not read as this
run's memory outside PyTorch. The thread only appends to a buffer; the main thread drains it at step end and writes
the `nvml` records, so the event file has one writer. The thread is a daemon, stopped by `stop()` (close, failure)
and by atexit, so it can neither keep a dead run alive nor outlive a clean one.
"""
from __future__ import annotations

import atexit
import os
import threading
import time
from typing import Any

import torch


def _device_handle(pynvml: Any) -> Any:
    """The NVML handle of this process's CUDA device, by UUID so CUDA_VISIBLE_DEVICES remapping cannot mislead."""
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        return pynvml.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
    return pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())


class NvmlSampler:
    def __init__(self, interval_s: float):
        self.interval_s = interval_s
        self.status = "off"
        self._samples: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if interval_s > 0:
            self._start()

    def _start(self) -> None:
        if not torch.cuda.is_available():
            self.status = "disabled: no CUDA device"
            return
        try:
            import pynvml
        except ImportError:
            self.status = "disabled: pynvml not installed (pip install nvidia-ml-py)"
            return
        try:
            pynvml.nvmlInit()
            handle = _device_handle(pynvml)
        except pynvml.NVMLError as exc:
            self.status = f"disabled: NVML failed ({exc})"
            return
        self.status = f"sampling every {self.interval_s} s"
        self._thread = threading.Thread(target=self._run, args=(pynvml, handle), name="nvml-sampler", daemon=True)
        self._thread.start()
        atexit.register(self.stop)

    def _run(self, pynvml: Any, handle: Any) -> None:
        try:
            while not self._stop.is_set():
                sample = _sample(pynvml, handle)
                with self._lock:
                    self._samples.append(sample)
                self._stop.wait(self.interval_s)
        except pynvml.NVMLError as exc:
            self.status = f"stopped: NVML failed while sampling ({exc})"
        finally:
            pynvml.nvmlShutdown()

    def drain(self) -> list[dict[str, Any]]:
        with self._lock:
            samples, self._samples = self._samples, []
        return samples

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=max(5.0, 2 * self.interval_s))


def _sample(pynvml: Any, handle: Any) -> dict[str, Any]:
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    util = pynvml.nvmlDeviceGetUtilizationRates(handle)
    return {
        "t_sample": time.time(),
        "used_bytes": int(memory.used),
        "total_bytes": int(memory.total),
        "gpu_util_pct": int(util.gpu),
        "mem_util_pct": int(util.memory),
        "power_w": pynvml.nvmlDeviceGetPowerUsage(handle) / 1e3,
        "sm_clock_mhz": int(pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM)),
        **_processes(pynvml, handle),
    }


def _processes(pynvml: Any, handle: Any) -> dict[str, int]:
    """The sample's per-process fields, or none where the driver refuses the process list."""
    try:
        listed = [(proc.pid, proc.usedGpuMemory) for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)]
    except pynvml.NVMLError:
        return {}
    return process_split(listed, os.getpid())


def process_split(listed: list[tuple[int, int | None]], own_pid: int) -> dict[str, int]:
    """`processes` (how many NVML lists), and where it can tell them apart, `own_bytes` (the process `own_pid`) and
    `other_processes_bytes` (the rest): not where this process is not listed (NVML reports pids of another PID
    namespace) or a listed process has no byte figure (NVML_VALUE_NOT_AVAILABLE, read as None)."""
    split = {"processes": len(listed)}
    own = [used for pid, used in listed if pid == own_pid]
    others = [used for pid, used in listed if pid != own_pid]
    if len(own) == 1 and own[0] is not None and None not in others:
        split |= {"own_bytes": int(own[0]), "other_processes_bytes": int(sum(others))}
    return split
