"""The schedule plan: what each pipeline stage does in one step, and in which order, as a pure function.

A stage's plan is its ordered work items (forward or backward of one micro-batch on one model chunk), grouped into
steps, each step followed by the one P2P exchange that sends its results and receives what the next step needs. The real
schedules (schedules.py) execute exactly this plan. The ledger derives the same order on its own
(ledger/models/schedule.py, for charts and the time model) and a test holds the two equal.

The order is Megatron Core's (schedules.py; docs/engine.md, "Schedules"):
  1F1B:        stage i runs min(p - i - 1, m) warmup forwards, then alternates one forward / one backward, then
               drains the remaining backwards (cooldown).
  interleaved: V chunks per stage; a stage's k-th forward is micro-batch (k // pV) * p + k % p on chunk
               (k % pV) // p, its k-th backward the same micro-batch on chunk V - 1 - (k % pV) // p. Warmup is
               2 (p - i - 1) + (V - 1) p forwards (all of them when m == p); m must be a multiple of p.
Chunk c of stage i is virtual stage c * p + i: activations flow through the virtual stages in order, so the last
stage's chunk c feeds the first stage's chunk c + 1.

"""
from __future__ import annotations

from dataclasses import dataclass

from common.errors import ConfigError

FORWARD, BACKWARD = "F", "B"


@dataclass(frozen=True)
class WorkItem:
    kind: str  # FORWARD or BACKWARD
    microbatch: int
    chunk: int = 0

    def label(self, chunked: bool = False) -> str:
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if chunked else "")


@dataclass(frozen=True)
class Exchange:
    """One P2P call: send what the step just computed, receive the inputs of the next step.

    send_forward: the activation to the next stage; send_backward: the input gradient to the previous one;
    recv_forward: an activation from the previous stage; recv_backward: an output gradient from the next one.
    """
    send_forward: bool = False
    send_backward: bool = False
    recv_forward: bool = False
    recv_backward: bool = False


@dataclass(frozen=True)
class Step:
    """Work items run back to back (one, or a forward and a backward in the interleaved steady state), then
    `exchange`."""
    items: tuple[WorkItem, ...]
    exchange: Exchange


@dataclass(frozen=True)
class StagePlan:
    stage: int
    first_exchange: Exchange  # receives the first step's inputs
    steps: list[Step]
    num_warmup: int

    @property
    def items(self) -> list[WorkItem]:
        return [item for step in self.steps for item in step.items]


def check_plan_arguments(pipeline_size: int, num_microbatches: int, virtual_size: int = 1) -> None:
    if pipeline_size < 1:
        raise ConfigError(f"pipeline size must be >= 1, got {pipeline_size}")
    if num_microbatches < 1:
        raise ConfigError(f"number of micro-batches must be >= 1, got {num_microbatches}")
    if virtual_size < 1:
        raise ConfigError(f"virtual pipeline size must be >= 1, got {virtual_size}")
    if virtual_size > 1 and pipeline_size < 2:
        raise ConfigError(f"the interleaved schedule (virtual pipeline size {virtual_size}) needs a pipeline size "
                          f">= 2, got {pipeline_size}")
    if virtual_size > 1 and num_microbatches % pipeline_size:
        raise ConfigError(f"the interleaved schedule needs the number of micro-batches ({num_microbatches}) to be a "
                          f"multiple of the pipeline size ({pipeline_size})")


def num_warmup_microbatches(pipeline_size: int, stage: int, num_microbatches: int, virtual_size: int = 1) -> int:
    """Forwards a stage runs before its first backward (counted in chunk forwards when interleaved)."""
    if virtual_size == 1:
        return min(pipeline_size - stage - 1, num_microbatches)
    total = num_microbatches * virtual_size
    if num_microbatches == pipeline_size:
        return total
    return min(2 * (pipeline_size - stage - 1) + (virtual_size - 1) * pipeline_size, total)


def _virtual_item(kind: str, k: int, pipeline_size: int, virtual_size: int) -> WorkItem:
    """The k-th forward (or backward) of a stage: micro-batches advance in groups of p per chunk."""
    group = pipeline_size * virtual_size
    chunk = (k % group) // pipeline_size
    if kind == BACKWARD:
        chunk = virtual_size - 1 - chunk
    return WorkItem(kind, (k // group) * pipeline_size + k % pipeline_size, chunk)


def stage_steps(pipeline_size: int, stage: int, num_microbatches: int, virtual_size: int = 1,
                forward_only: bool = False) -> tuple[list[tuple[WorkItem, ...]], int]:
    """(ordered steps of work items, number of warmup forwards) of one stage.

    1F1B exchanges after every item (send_forward_recv_backward between a steady forward and its backward);
    the interleaved steady state runs its forward and backward back to back and exchanges once for both, as
    Megatron does: with chunks wrapping from the last stage to the first, exchanging between them would deadlock.
    """
    total = num_microbatches * virtual_size
    forwards = [_virtual_item(FORWARD, k, pipeline_size, virtual_size) for k in range(total)]
    if forward_only:
        return [(f,) for f in forwards], total
    backwards = [_virtual_item(BACKWARD, k, pipeline_size, virtual_size) for k in range(total)]
    warmup = num_warmup_microbatches(pipeline_size, stage, num_microbatches, virtual_size)
    steady = [(forwards[warmup + k], backwards[k]) for k in range(total - warmup)]
    if virtual_size == 1:
        steady = [(item,) for pair in steady for item in pair]
    return [(f,) for f in forwards[:warmup]] + steady + [(b,) for b in backwards[total - warmup:]], warmup


def is_first_virtual_stage(pipeline_size: int, stage: int, chunk: int) -> bool:
    return stage == 0 and chunk == 0


def is_last_virtual_stage(pipeline_size: int, stage: int, chunk: int, virtual_size: int) -> bool:
    return stage == pipeline_size - 1 and chunk == virtual_size - 1


def _needs_input(item: WorkItem, pipeline_size: int, stage: int, virtual_size: int) -> bool:
    """A forward needs an activation unless it is the very first virtual stage; a backward needs an output
    gradient unless it is the very last (whose output is the loss)."""
    if item.kind == FORWARD:
        return not is_first_virtual_stage(pipeline_size, stage, item.chunk)
    return not is_last_virtual_stage(pipeline_size, stage, item.chunk, virtual_size)


def _sends_result(item: WorkItem, pipeline_size: int, stage: int, virtual_size: int) -> bool:
    if item.kind == FORWARD:
        return not is_last_virtual_stage(pipeline_size, stage, item.chunk, virtual_size)
    return not is_first_virtual_stage(pipeline_size, stage, item.chunk)


def stage_plan(pipeline_size: int, stage: int, num_microbatches: int, virtual_size: int = 1,
               forward_only: bool = False) -> StagePlan:
    check_plan_arguments(pipeline_size, num_microbatches, virtual_size)
    steps, warmup = stage_steps(pipeline_size, stage, num_microbatches, virtual_size, forward_only)

    def needs(step: tuple[WorkItem, ...], kind: str) -> bool:
        return any(i.kind == kind and _needs_input(i, pipeline_size, stage, virtual_size) for i in step)

    def sends(step: tuple[WorkItem, ...], kind: str) -> bool:
        return any(i.kind == kind and _sends_result(i, pipeline_size, stage, virtual_size) for i in step)

    planned = []
    for j, step in enumerate(steps):
        following = steps[j + 1] if j + 1 < len(steps) else ()
        planned.append(Step(step, Exchange(sends(step, FORWARD), sends(step, BACKWARD),
                                           needs(following, FORWARD), needs(following, BACKWARD))))
    first = Exchange(recv_forward=needs(steps[0], FORWARD), recv_backward=needs(steps[0], BACKWARD))
    return StagePlan(stage, first, planned, warmup)
