"""The pipeline schedule as the ledger derives it, independently of the engine: for charts and a time model.

Why a second derivation: the ledger checks the engine's pipeline against what Megatron Core's schedules do; reading
the order from the engine would make an engine bug reconcile as "ok". The order here is built from Megatron's
interleaved-schedule helpers (schedules.py, get_model_chunk_id / get_microbatch_id_in_model_chunk): a stage's k-th
forward runs chunk (k mod pv) // p on micro-batch (k // pv) * p + k mod p, its k-th backward the same micro-batch on
the mirrored chunk v - 1 - chunk; with v = 1 this is plain 1F1B. A stage runs `warmup_count` forwards, then pairs
one forward with one backward, then drains the backwards.

`simulate` replays every stage's order on a global clock with optional per-(stage, item) durations, so a time model
can pass measured forward/backward times. No closed-form bubble lives here: that is ledger.models.formulas.bubble.
Torch-free: imports common.* only.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from common.errors import ConfigError

FORWARD, BACKWARD = "F", "B"
MAX_ITEMS = 2_000_000  # work items in one chart (2 p m v): beyond this a chart is neither drawable nor quick
MAX_CELLS = 4_000_000  # a chart's stages x its clock, 2 (v m + p - 1) cells long: ~20 MB of text


@dataclass(frozen=True)
class Item:
    """One unit of a stage's work: the forward or backward of one micro-batch on one model chunk."""
    kind: str  # FORWARD or BACKWARD
    microbatch: int
    chunk: int = 0

    def label(self, chunked: bool = False) -> str:
        return f"{self.kind}{self.microbatch}" + (f"c{self.chunk}" if chunked else "")


def check(p: int, m: int, v: int = 1) -> None:
    """ConfigError for a schedule that cannot run (the engine's conditions) or is too large to chart."""
    if p < 1:
        raise ConfigError(f"pipeline size must be >= 1, got {p}")
    if m < 1:
        raise ConfigError(f"number of micro-batches must be >= 1, got {m}")
    if v < 1:
        raise ConfigError(f"virtual pipeline size must be >= 1, got {v}")
    if v > 1 and p < 2:
        raise ConfigError(f"the interleaved schedule (virtual pipeline size {v}) needs a pipeline size >= 2, got {p}")
    if v > 1 and m % p:
        raise ConfigError(f"the interleaved schedule needs the number of micro-batches ({m}) to be a multiple of "
                          f"the pipeline size ({p})")
    if 2 * p * m * v > MAX_ITEMS:
        raise ConfigError(f"the chart is bounded to {MAX_ITEMS:,} work items; p x m x v x 2 = {p} x {m} x {v} x 2 "
                          f"= {2 * p * m * v:,}")


def check_chart(p: int, m: int, v: int = 1) -> None:
    """check(), and ConfigError for a chart too large to print (many stages make it wide as well as tall)."""
    check(p, m, v)
    cells = p * 2 * (v * m + p - 1)
    if cells > MAX_CELLS:
        raise ConfigError(f"the chart is bounded to {MAX_CELLS:,} cells; stages x clock = {p} x 2 x ({v} x {m} + {p} "
                          f"- 1) = {cells:,}")


def warmup_count(p: int, stage: int, m: int, v: int = 1) -> int:
    """Forwards a stage runs before its first backward (chunk forwards when interleaved), per Megatron."""
    if v == 1:
        return min(p - stage - 1, m)
    total = m * v
    return total if m == p else min(2 * (p - stage - 1) + (v - 1) * p, total)


def _kth(kind: str, k: int, p: int, v: int) -> Item:
    """Megatron's helpers: model chunk and micro-batch of a stage's k-th forward (or backward)."""
    in_group = k % (p * v)
    chunk = in_group // p
    return Item(kind, (k // (p * v)) * p + k % p, v - 1 - chunk if kind == BACKWARD else chunk)


def stage_order(p: int, stage: int, m: int, v: int = 1) -> list[Item]:
    """The order in which `stage` runs its forwards and backwards: warmup, steady one-forward-one-backward,
    cooldown."""
    check(p, m, v)
    if not 0 <= stage < p:
        raise ConfigError(f"stage {stage} is outside a pipeline of {p} stages")
    total, warmup = m * v, warmup_count(p, stage, m, v)
    order: list[Item] = []
    fwd = bwd = 0
    while fwd < total or bwd < total:
        if fwd < total:
            order.append(_kth(FORWARD, fwd, p, v))
            fwd += 1
        if fwd > warmup or fwd == total:  # past warmup every forward is followed by one backward
            if bwd < total:
                order.append(_kth(BACKWARD, bwd, p, v))
                bwd += 1
    return order


Span = tuple[float, float, Item]


@dataclass(frozen=True)
class Timeline:
    """Per stage, its (start, end, item) spans in run order; the makespan is the end of the last one."""
    p: int
    m: int
    v: int
    stages: tuple[tuple[Span, ...], ...]
    makespan: float

    def busy(self, stage: int) -> float:
        return sum(end - start for start, end, _ in self.stages[stage])

    def bubble_fraction(self) -> float:
        """Idle time over all stage time (stages x makespan): the wall-time convention."""
        if not self.makespan:
            return 0.0
        return 1 - sum(self.busy(s) for s in range(self.p)) / (self.p * self.makespan)

    def cells(self) -> list[list[Item | None]]:
        """For unit durations, the chart: one row per stage, one entry per clock cell, None when idle."""
        width = int(self.makespan)
        rows: list[list[Item | None]] = [[None] * width for _ in range(self.p)]
        for s, spans in enumerate(self.stages):
            for start, end, item in spans:
                if end - start != 1 or start != int(start):
                    raise ValueError("cells() needs unit durations (every item one cell long)")
                rows[s][int(start)] = item
        return rows


def _needs(item: Item, vstage: int, last: int) -> list[tuple[str, int, int]]:
    """(kind, micro-batch, virtual stage) that must be done before `item` runs on virtual stage `vstage`."""
    if item.kind == FORWARD:
        return [(FORWARD, item.microbatch, vstage - 1)] if vstage else []
    after = [(BACKWARD, item.microbatch, vstage + 1)] if vstage < last else []
    return [(FORWARD, item.microbatch, vstage)] + after


def simulate(p: int, m: int, v: int = 1,
             durations: Callable[[int, Item], float] | None = None) -> Timeline:
    """Replay each stage's order on a global clock: an item starts when its stage is free and every item it needs
    is done (zero P2P latency). `durations(stage, item)` gives seconds; by default every item takes one cell.
    ValueError when the orders deadlock."""
    check(p, m, v)
    cost = durations or (lambda stage, item: 1)
    orders = [stage_order(p, s, m, v) for s in range(p)]
    last = p * v - 1
    done: dict[tuple[str, int, int], float] = {}
    blocked: dict[tuple[str, int, int], list[int]] = {}  # missing work -> stages waiting on it
    position, free = [0] * p, [0.0] * p
    spans: list[list[Span]] = [[] for _ in range(p)]
    runnable = list(range(p))
    while runnable:
        s = runnable.pop()
        while position[s] < len(orders[s]):
            item = orders[s][position[s]]
            vstage = item.chunk * p + s
            needs = _needs(item, vstage, last)
            missing = [key for key in needs if key not in done]
            if missing:
                blocked.setdefault(missing[0], []).append(s)
                break
            seconds = cost(s, item)
            if seconds < 0:
                raise ValueError(f"negative duration {seconds} for {item.label(v > 1)} on stage {s}")
            start = max([free[s]] + [done[key] for key in needs])
            free[s] = start + seconds
            spans[s].append((start, free[s], item))
            key = (item.kind, item.microbatch, vstage)
            done[key] = free[s]
            runnable.extend(blocked.pop(key, []))
            position[s] += 1
    if any(position[s] < len(orders[s]) for s in range(p)):
        raise ValueError(f"the schedule deadlocks: stages wait at item positions {position}")
    makespan = max((spans[s][-1][1] for s in range(p) if spans[s]), default=0.0)
    return Timeline(p, m, v, tuple(tuple(row) for row in spans), makespan)
