"""The simulator judged on real runs: a run directory (ours or Megatron-LM's) replayed through `simulate` on the
hardware file of the GPU it ran on, its step time, peak memory and pipeline bubble predicted vs measured.

The prediction uses the run's configuration and the hardware file only: never the run's own sweeps or step times.
The measurement is what `reconcile` reads from the run (ledger/reconcile): the median step time of the steady steps,
the largest PyTorch allocator peak over ranks (memory_stats, so the prediction compared is the allocator's part of
the peak, without what lies outside PyTorch), and the pipeline bubble of wall time averaged over stages.
Goals (issue 18): step time within 5%, peak memory within 3%. Beside them, not a goal: the critical stage's forward
range on the host's clock (what the host took to issue it, where the timers kept host times) against the host
timeline's from the file's host block: where a launch-bound step misses, this says whether its host's pace did.
And where the run's steady pace moved by more than the step goal within its window (ledger.reconcile.throughput
PaceDrift), the measured median mixes two paces: the table marks that error rather than let it pass for the model's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from statistics import mean, median
from typing import Any

from common.errors import InputError
from ledger.evidence.read import read_run
from ledger.evidence.steps import run_steps
from ledger.models.schedule import FORWARD
from ledger.models.simulate.hardware import hardware_for, kind_of, run_device
from ledger.models.simulate.simulation import Simulation, simulate
from ledger.reconcile.run import eager_fusions_on_gpu, reconcile_evidence
from ledger.reconcile.throughput import PaceDrift, pace_drift, steady_records, timed_records

STEP_GOAL, PEAK_GOAL = 0.05, 0.03


@dataclass(frozen=True)
class Measured:
    step_time: float | None
    peak_bytes: int | None
    bubble: float | None
    device: str | None
    host_forward: dict[int, float] = field(default_factory=dict)  # stage -> its forward range on the host's clock
    pace: PaceDrift | None = None  # where the steady steps' pace moved by more than the step goal within the window


@dataclass(frozen=True)
class Validation:
    run: str
    framework: str
    sim: Simulation
    measured: Measured
    eager_fusions: bool = False  # ran its fusions eager (TRAIN_LEDGER_COMPILE=0): the simulator prices them compiled

    @property
    def predicted_peak(self) -> int:
        return max(m.peak.total for m in self.sim.memory)

    @property
    def predicted_host_forward(self) -> float | None:
        """The critical stage's forward range on the host timeline (None without a host block)."""
        return self.sim.step.stages[self.sim.step.critical_stage].host_ranges.get(FORWARD)

    @property
    def measured_host_forward(self) -> float | None:
        return self.measured.host_forward.get(self.sim.step.critical_stage)

    @property
    def predicted_bubble(self) -> float | None:
        stages = self.sim.step.stages
        return mean(s.bubble for s in stages) if len(stages) > 1 else None

    def errors(self) -> dict[str, float | None]:
        """(predicted - measured) / measured of each figure; None where the run has no measurement."""
        m = self.measured

        def rel(predicted: float | None, measured: float | None) -> float | None:
            return None if predicted is None or not measured else (predicted - measured) / measured
        return {"step_time": rel(self.sim.step.step_time, m.step_time),
                "peak_bytes": rel(self.predicted_peak, m.peak_bytes),
                "bubble": (self.predicted_bubble - m.bubble) if self.predicted_bubble is not None
                and m.bubble is not None else None,
                "host_forward": rel(self.predicted_host_forward, self.measured_host_forward)}

    @property
    def on_predicted_hardware(self) -> bool | None:
        """Whether the run's GPU is the kind predicted (None: the run does not name its device). Predicting an
        H100 run on the H200 file measures the two GPUs' difference as much as the simulator."""
        if self.measured.device is None:
            return None
        return kind_of(self.sim.hardware.name) in self.measured.device.lower()

    def within_goals(self) -> bool:
        e = self.errors()
        return all(v is not None and abs(v) <= goal for v, goal in ((e["step_time"], STEP_GOAL),
                                                                    (e["peak_bytes"], PEAK_GOAL)))

    def to_dict(self) -> dict[str, Any]:
        m = self.measured
        return {"run": self.run, "framework": self.framework, "hardware": self.sim.hardware.name,
                "device": m.device, "on_predicted_hardware": self.on_predicted_hardware,
                "layout": self.sim.to_dict()["layout"],
                "predicted": {"step_time_s": self.sim.step.step_time, "peak_bytes": self.predicted_peak,
                              "bubble": self.predicted_bubble, "host_forward_s": self.predicted_host_forward},
                "measured": {"step_time_s": m.step_time, "peak_bytes": m.peak_bytes, "bubble": m.bubble,
                             "host_forward_s": self.measured_host_forward,
                             "pace_change": m.pace.change if m.pace is not None else None},
                "errors": self.errors(), "within_goals": self.within_goals(), "eager_fusions": self.eager_fusions}


def measured_values(rows: list[dict[str, Any]], metric: str) -> list[float]:
    """Every measured value of a reconciliation row metric (rows as to_dict() writes them)."""
    return [r["measured"] for r in rows if r["metric"] == metric and r.get("measured") is not None]


def measured(rows: list[dict[str, Any]], device: str | None, pace: PaceDrift | None = None) -> Measured:
    step = measured_values(rows, "throughput.step_time")
    peak = measured_values(rows, "memory.peak_allocated")
    bubble = measured_values(rows, "pipeline.bubble_of_wall_time")
    host = [r for r in rows if r["metric"] == "time.host_forward_per_microbatch" and r.get("measured") is not None]
    host_forward = {s: median(r["measured"] for r in host if r["stage"] == s) for s in {r["stage"] for r in host}}
    return Measured(step_time=max(step) if step else None, peak_bytes=int(max(peak)) if peak else None,
                    bubble=mean(bubble) if bubble else None, device=device, host_forward=host_forward, pace=pace)


def validate_run(run_dir: str | Path, hardware: str | None = None) -> Validation:
    if not Path(run_dir).is_dir():
        raise InputError(str(run_dir), "not a run directory")
    ev = read_run(run_dir)  # read once: its config and manifest here, its measurements through the reconciliation
    if ev.config is None:
        raise InputError(str(run_dir), "the run's configuration cannot be read: nothing to simulate")
    device = run_device(ev.rank_infos.values())
    if {info.device.type for info in ev.rank_infos.values()} == {"cpu"}:
        raise InputError(str(run_dir), f"ran on the CPU ({device}): simulate predicts GPUs, so this run's step time "
                                       "and memory cannot judge it; validate a GPU run")
    hw = hardware_for(device, hardware)
    rows = [r.to_dict() for r in reconcile_evidence(ev).rows]
    pace = pace_drift(steady_records(timed_records(ev), run_steps(ev)))
    return Validation(run=str(run_dir), framework=ev.framework, sim=simulate(ev.config, hw),
                      measured=measured(rows, device, pace), eager_fusions=eager_fusions_on_gpu(ev))
