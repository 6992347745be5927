"""DP communication of one stage in a step: when each bucket's collective is issued, when it runs, how much of it no
compute hides.

Grad reduction (reduce-scatter under the distributed optimizer, else all-reduce), Megatron's schedules:
- without --overlap-grad-reduce every bucket (one per model chunk) is reduced in finalize_model_grads, after the
  stage's last backward and its P2P exchange, one after the other: nothing hides them;
- with it and no interleaving, the stage that runs its last backward with DDP's hooks enabled (no pipelining, and
  stage 0 of 1F1B) issues bucket b as soon as the last of its parameters has its final gradient: at the last
  backward's start + `ready_offsets` (the backward's grad-final marks over the buffer layout,
  ledger/models/formulas/buffer_layout.py); the other stages issue their one bucket after their last exchange;
- interleaved, stage s launches the chunk whose last backward was its (k - s)-th right after its k-th backward
  (Megatron's grad_sync_microbatch_id), and any chunk left when the schedule ends.
Param all-gather (distributed optimizer): with --overlap-param-gather, chunk 0's last bucket group (the first
layers) is issued at the step's start and each forward pre-hook waits for its group and issues the next
(`gather_chain`); interleaved, chunk 0's groups are all issued at the schedule's start and chunk c's at chunk c - 1's
first forward. Without it every bucket is gathered after the optimizer step, synchronously.
Collectives of one group run one after another, in issue order (one NCCL communicator, one stream).
"""
from __future__ import annotations

from dataclasses import dataclass

from common.intervals import Interval, covered, union
from ledger.models.formulas.buffer_layout import BufferLayout


@dataclass(frozen=True)
class BucketComm:
    """One bucket's collective in the step, on the stage's clock (seconds from the step start)."""
    stage: int
    chunk: int
    bucket: int
    op: str  # reduce_scatter | all_reduce | all_gather
    size_bytes: int
    issue: float
    start: float
    end: float
    exposed: float = 0.0  # of [start, end], the time no compute of the stage ran beside it


def ready_offsets(layout: BufferLayout, grad_final: dict[str, float]) -> list[float]:
    """Per bucket, the backward offset at which the last of its parameters has its final gradient."""
    ready = [0.0] * len(layout.buckets)
    for name, (_, _, bucket) in layout.param_ranges.items():
        ready[bucket] = max(ready[bucket], grad_final[name])
    return ready


def first_use_offsets(layout: BufferLayout, first_use: dict[str, float]) -> list[float]:
    """Per bucket, the forward offset at which the first of its parameters is used (its pre-hook waits there)."""
    used = [float("inf")] * len(layout.buckets)
    for name, (_, _, bucket) in layout.param_ranges.items():
        used[bucket] = min(used[bucket], first_use[name])
    return used


def serial(issues: list[tuple[float, float]], free_at: float = 0.0) -> list[Interval]:
    """(issue, duration) of collectives on one communicator, in issue order -> their (start, end)."""
    out = []
    for issue, seconds in issues:
        start = max(issue, free_at)
        free_at = start + seconds
        out.append((start, free_at))
    return out


@dataclass(frozen=True)
class Gathers:
    """A chunk's param all-gathers before its first forward: their intervals and the waits the forward makes."""
    issues: list[float]
    intervals: list[Interval]
    waits: list[float]

    @property
    def total_wait(self) -> float:
        return sum(self.waits)


def gather_chain(forward_start: float, first_issue: float, offsets: list[float], seconds: list[float],
                 chained: bool, free_at: float = 0.0) -> Gathers:
    """Buckets in forward order (`offsets`: where the forward first needs each). chained: the first is issued at
    `first_issue` and each next one when the pre-hook has waited for the one before; else all at `first_issue`. The
    forward reaches bucket j at forward_start + offsets[j] + the waits before it and waits there for its end."""
    issues, intervals, waits = [], [], []
    waited, issue = 0.0, first_issue
    for offset, duration in zip(offsets, seconds):
        start = max(issue, free_at)
        free_at = start + duration
        reach = forward_start + offset + waited
        wait = max(0.0, free_at - reach)
        waited += wait
        issues.append(issue)
        intervals.append((start, free_at))
        waits.append(wait)
        if chained:
            issue = reach + wait
    return Gathers(issues, intervals, waits)


def exposed(intervals: list[Interval], compute: list[Interval]) -> float:
    """Time within the union of `intervals` that `compute` (disjoint, sorted) does not cover."""
    return sum((end - start) - covered((start, end), compute) for start, end in union(intervals))
