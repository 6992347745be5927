"""NVML's per-process accounting in the nvml probe (probes/nvml.py): which process holds what on the device, so that
another process's memory on the same GPU is not read as this run's memory outside PyTorch. No NVML here: a stand-in
module answers the calls the sampler makes, with the figures NVML reports."""
from __future__ import annotations

from types import SimpleNamespace

from probes import nvml
from probes.nvml import process_split

GiB = 2**30


def test_this_process_and_the_others_are_told_apart_by_pid():
    listed = [(11, 3 * GiB), (42, 5 * GiB), (12, 1 * GiB)]
    assert process_split(listed, own_pid=42) == {"processes": 3, "own_bytes": 5 * GiB,
                                                 "other_processes_bytes": 4 * GiB}
    assert process_split([(42, 5 * GiB)], own_pid=42) == {"processes": 1, "own_bytes": 5 * GiB,
                                                          "other_processes_bytes": 0}


def test_nothing_is_split_where_nvml_cannot_tell_the_processes_apart():
    # pids of another PID namespace (this process not listed), or a process without a byte figure
    assert process_split([(7, GiB), (8, GiB)], own_pid=42) == {"processes": 2}
    assert process_split([(42, 5 * GiB), (8, None)], own_pid=42) == {"processes": 2}
    assert process_split([(42, None)], own_pid=42) == {"processes": 1}


class FakeNvml:
    """The NVML calls of one sample, answering with fixed figures; `processes` None: the driver refuses the list."""

    NVML_CLOCK_SM = 1

    class NVMLError(Exception):
        pass

    def __init__(self, processes: list[SimpleNamespace] | None):
        self.processes = processes

    def nvmlDeviceGetMemoryInfo(self, handle):
        return SimpleNamespace(used=9 * GiB, total=141 * GiB)

    def nvmlDeviceGetUtilizationRates(self, handle):
        return SimpleNamespace(gpu=100, memory=30)

    def nvmlDeviceGetPowerUsage(self, handle):
        return 690_000

    def nvmlDeviceGetClockInfo(self, handle, clock):
        return 1590

    def nvmlDeviceGetComputeRunningProcesses(self, handle):
        if self.processes is None:
            raise self.NVMLError("Not Supported")
        return self.processes


def test_a_sample_carries_the_split_beside_the_device_figures(monkeypatch):
    monkeypatch.setattr(nvml.os, "getpid", lambda: 42)
    fake = FakeNvml([SimpleNamespace(pid=42, usedGpuMemory=3 * GiB), SimpleNamespace(pid=7, usedGpuMemory=5 * GiB)])
    sample = nvml._sample(fake, handle=None)
    assert sample["used_bytes"] == 9 * GiB and sample["sm_clock_mhz"] == 1590
    assert (sample["processes"], sample["own_bytes"], sample["other_processes_bytes"]) == (2, 3 * GiB, 5 * GiB)


def test_a_driver_that_refuses_the_process_list_leaves_the_sample_as_before():
    sample = nvml._sample(FakeNvml(None), handle=None)
    assert sample["used_bytes"] == 9 * GiB
    assert not {"processes", "own_bytes", "other_processes_bytes"} & set(sample)
