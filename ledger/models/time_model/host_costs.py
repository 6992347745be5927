"""What each host primitive (common/ops/host.py) costs on the run's host: from the run's own host sweep (`host`
records) or a hardware file's `host` block (ledger/models/simulate/hardware.py), plain and under torch.profiler.
docs/formulas.md, "Host timeline".
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import Iterable, Mapping

from common.events import HostRecord
from common.ops import host as p

# From a launch call's end to the device starting its kernel on an idle stream: the calibration run
# h200_2layer_profiled's mean over the kernels launched after the device had gone idle (1.30-1.58 µs in its three
# profiled steps; tests/test_step_decomposition.py).
LAUNCH_LATENCY = 1.45e-6
# Between two kernels the device already holds, under the profiler: the calibration run h200_2layer_profiled's mean
# gap over its queued kernels (1.64-1.71 µs in its three steps; tests/test_step_decomposition.py). Inside the compute
# sweep's seconds (each kernel timed with its start-up); the step decomposition books it as launch latency.
KERNEL_GAP = 1.66e-6
# The probes' step end writes one record per timer range (probes/probe_set.py step_end), in Python, with the device
# idle: the calibration run's window ends 0.60-0.65 ms after its last event sync, over its 10 ranges a step.
RECORD_WRITE = 62e-6
# A profiler window's first step begins with the profiler's own start on the host: 2.29 ms before the calibration
# run's first event record in its window's first step (0.03-0.09 ms in the later ones).
PROFILER_START = 2.29e-3
CPU_NOTE = ("host timeline off: a CPU rank runs its ops on the calling thread (no launch), and the compute sweep's "
            "timings hold their dispatch")


@dataclass(frozen=True)
class HostCosts:
    """Seconds per call of each primitive on the run's host, plain and under torch.profiler (empty: not measured)."""
    seconds: Mapping[str, float]
    profiled: Mapping[str, float]
    source: str
    launch_latency: float = LAUNCH_LATENCY
    kernel_gap: float = KERNEL_GAP
    record_write: float = RECORD_WRITE
    profiler_start: float = PROFILER_START
    # The Python around the calls in the code the recipes describe; None: that code's own (host_recipe.CONTEXT,
    # megatron_host_recipe.CONTEXT), set by the host timeline
    context: float | None = None
    # This engine's recipes' contexts on this host, (forward, backward), calibrated on runs of this host (a hardware
    # file's host block, runs/bench/host_contexts.py); None: host_recipe.CONTEXT for both
    engine_contexts: tuple[float, float] | None = None
    # Megatron-LM's recipes' context on this host, calibrated on a Megatron-LM run of this host (a hardware file's
    # host block, runs/bench/host_model.py --write); None: megatron_host_recipe.CONTEXT
    megatron_context: float | None = None

    def price(self, counts: Mapping[str, float], profiled: bool = False) -> float:
        """The host's seconds for `counts` of each primitive in their code's context: the calls (under the profiler,
        at their profiled cost) and the Python around them, (context - 1) x their plain cost, which the profiler
        (recording ops, not Python calls) leaves as it is."""
        plain = sum(n * self.seconds[k] for k, n in counts.items())
        calls = sum(n * self.profiled[k] for k, n in counts.items()) if profiled else plain
        return calls + (self.context - 1.0) * plain

    def plain(self, counts: Mapping[str, float]) -> float:
        """The calls' own seconds, no context: what a measured pass (PASS_FORWARD, PASS_BACKWARD) is set against."""
        return sum(n * self.seconds[k] for k, n in counts.items())

    def measured(self, op: str, profiled: bool = False) -> float | None:
        """A measured pass's seconds (plain or under the profiler), None where the sweep did not time it."""
        return (self.profiled if profiled else self.seconds).get(op)

    @property
    def has_profiled(self) -> bool:
        return all(k in self.profiled for k in self.seconds)


def host_costs(records: Iterable[HostRecord]) -> tuple[HostCosts | None, str | None]:
    """The run's host costs (the median over its ranks' records of each primitive), or None and why not."""
    records = list(records)
    if not records:
        return None, "host timeline off: no host sweep (--host-sweep)"
    if any(r.launches is False for r in records):
        return None, CPU_NOTE
    seconds = {op: median(r.seconds for r in records if r.op == op) for op in {r.op for r in records}}
    absent = [op for op in p.HOST_PRIMITIVES if op not in seconds]
    if absent:
        return None, f"host timeline off: the host sweep has no record of {', '.join(absent)}"
    profiled = {op: median(r.profiled_seconds for r in records if r.op == op and r.profiled_seconds is not None)
                for op in seconds if any(r.op == op and r.profiled_seconds is not None for r in records)}
    cpus = sorted({r.cpu or "unknown CPU" for r in records})
    versions = sorted({r.torch or "unknown torch" for r in records})
    return HostCosts(seconds, profiled, f"this run's host sweep ({', '.join(cpus)}; torch {', '.join(versions)})"), None
