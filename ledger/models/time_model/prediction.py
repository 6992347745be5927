"""What the time model predicts of a step (step.py replays it): per stage, its passes, bubble, exposed communication
and ranges on both clocks; for the step, its time term by term, its buckets' communication, the decomposition's
predicted terms and the device compute by class."""
from __future__ import annotations

from dataclasses import dataclass, field

from ledger.models.time_model.buckets import BucketComm
from ledger.models.time_model.compute import StageTime


@dataclass(frozen=True)
class StagePrediction:
    stage: int
    compute: StageTime  # forward / backward per micro-batch and their breakdown
    busy: float  # forward + backward time in the step (TP collectives inside them included)
    bubble: float  # 1 - busy / pipeline span
    bubble_without_comm: float  # the same with P2P transfers and param all-gather waits at zero
    exposed: dict[str, float]  # group -> seconds per step no compute hides: dp (union over time), tp, pp, embedding,
    # and cp under context parallelism (the ring's messages beyond the blocks they overlap)
    optimizer: float  # the optimizer range: waiting for the slowest stage, grad norm, update, synchronous gather
    grads_done: float  # when finalize_model_grads returns
    forward: float  # one forward range on the device, mean over its chunks: the compute's, or the host's pace
    backward: float
    delayed_wgrad: float  # --moe-delay-expert-wgrad's flush on the device (its `wgrad` range); 0 without
    # the same ranges on the host's clock (from its opening to its closing call: what it took to issue), by kind;
    # empty without a host timeline
    host_ranges: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class StepPrediction:
    step_time: float
    tokens_per_s: float
    stages: tuple[StagePrediction, ...]
    buckets: tuple[BucketComm, ...]
    terms: dict[str, float]  # the critical stage's step, term by term: they sum to step_time
    critical_stage: int
    span: float  # the pipeline span (first forward to last backward)
    notes: tuple[str, ...]
    # Per stage, the step decomposition's terms as the host timeline predicts them (the measured partition's names,
    # ledger.evidence.step_partition), under the profiled host costs where the host costs have them
    # (`decomposition_profiled`): empty without a host timeline.
    decompositions: dict[int, dict[str, float]] = field(default_factory=dict)
    decomposition_profiled: bool = False
    # Per stage, the device's own work in a step (its passes' kernels without their collectives, the memset, the
    # update): the decomposition's device-compute term, which needs no host clock.
    device_compute: dict[int, float] = field(default_factory=dict)
    # The same by compute class (common/ops/compute_class.py: matmul, attention, optimizer, other kernels).
    device_compute_by_class: dict[int, dict[str, float]] = field(default_factory=dict)
    power_factor: float = 1.0  # the slowdown of its passes' kernels it was priced at (the power limit)
    power_share: float = 0.0  # the share of its wall time the critical stage's GEMMs and attention fill
