"""ledger.models.schedule: the pipeline order and its replay, derived without the engine, and agreeing with it by test.

Specification: a stage runs Megatron's warmup forwards, then one forward / one backward, then the remaining
backwards; the k-th forward runs chunk (k mod pv) // p on micro-batch (k // pv) * p + k mod p, backwards the mirrored
chunk. Replayed with unit durations, the bubble equals ledger.models.formulas.bubble (the reference run's p=2, m=8
chart: 18 cells per stage, 4 idle cells of 36).
"""
from __future__ import annotations

import time
from fractions import Fraction

import pytest

from common.errors import ConfigError
from ledger.models.formulas.bubble import bubble
from ledger.models.schedule import (
    BACKWARD,
    FORWARD,
    MAX_ITEMS,
    Item,
    check,
    check_chart,
    simulate,
    stage_order,
    warmup_count,
)


def idle_fractions(timeline) -> list[float]:
    """Per stage, the share of the makespan it spends idle."""
    return [1 - timeline.busy(s) / timeline.makespan for s in range(timeline.p)]


def labels(order, chunked=False):
    return [item.label(chunked) for item in order]


def test_item_labels():
    assert Item(FORWARD, 3).label(False) == "F3"
    assert Item(FORWARD, 3, 1).label(True) == "F3c1"
    assert Item(BACKWARD, 0, 2).label() == "B0"


def test_reference_p2_m8():
    timeline = simulate(2, 8)
    assert timeline.makespan == 18
    cells = timeline.cells()
    assert sum(cell is None for row in cells for cell in row) == 4 and sum(map(len, cells)) == 36
    assert timeline.bubble_fraction() == pytest.approx(4 / 36) == pytest.approx(1 / 9)
    assert timeline.bubble_fraction() == pytest.approx(bubble(2, 8).of_wall_time)
    assert idle_fractions(timeline) == pytest.approx([2 / 18, 2 / 18])
    assert (warmup_count(2, 0, 8), warmup_count(2, 1, 8)) == (1, 0)
    assert labels(stage_order(2, 0, 8)) == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "F4", "B3", "F5", "B4", "F6",
                                            "B5", "F7", "B6", "B7"]
    assert labels(stage_order(2, 1, 8)) == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "F5", "B5",
                                            "F6", "B6", "F7", "B7"]
    assert [c.label() if c else "." for c in cells[0]] == (
        ["F0", "F1", ".", "B0", "F2", "B1", "F3", "B2", "F4", "B3", "F5", "B4", "F6", "B5", "F7", "B6", ".", "B7"])


def test_interleaved_p2_m4_v2_bubble():
    p, m, v = 2, 4, 2
    timeline = simulate(p, m, v)
    assert timeline.bubble_fraction() == pytest.approx((p - 1) / (v * m + p - 1))
    assert timeline.bubble_fraction() == pytest.approx(bubble(p, m, v).of_wall_time)
    assert (warmup_count(p, 0, m, v), warmup_count(p, 1, m, v)) == (4, 2)
    assert labels(stage_order(p, 0, m, v), True)[:6] == ["F0c0", "F1c0", "F0c1", "F1c1", "F2c0", "B0c1"]


@pytest.mark.parametrize("p,m,v", [(4, 8, 1), (4, 16, 1), (3, 9, 3), (4, 8, 2), (8, 16, 1), (3, 1, 1)])
def test_unit_bubble_matches_the_formula(p, m, v):
    assert simulate(p, m, v).bubble_fraction() == pytest.approx(bubble(p, m, v).of_wall_time)


def test_every_item_once_and_forward_before_backward():
    for p, m, v in [(4, 8, 2), (3, 5, 1), (3, 6, 3)]:
        for s in range(p):
            order = stage_order(p, s, m, v)
            assert len(order) == len(set(order)) == 2 * m * v
            seen = set()
            for item in order:
                if item.kind == BACKWARD:
                    assert (item.microbatch, item.chunk) in seen
                else:
                    seen.add((item.microbatch, item.chunk))


GRID = [(p, m, v) for p in range(1, 5) for v in (1, 2, 3)
        for m in sorted(set(range(1, 9)) | {p * k for k in range(1, 5)}) if v == 1 or (p > 1 and m % p == 0)]


def test_agrees_with_the_engine():
    """Order and warmup equal the plan the engine executes for every valid (p, m, v) of the grid. The engine is
    imported here only, never by the ledger."""
    from engine.pipeline_parallel.schedule_plan import stage_plan

    assert len(GRID) == 60
    for p, m, v in GRID:
        chunked = v > 1
        for s in range(p):
            plan = stage_plan(p, s, m, v)
            assert labels(stage_order(p, s, m, v), chunked) == labels(plan.items, chunked), (p, s, m, v)
            assert warmup_count(p, s, m, v) == plan.num_warmup, (p, s, m, v)


def test_the_replay_respects_every_dependency():
    """No item starts before the work it needs is done: a forward after the same micro-batch's forward on the
    virtual stage before, a backward after its own forward and the backward on the virtual stage after."""
    for p, m, v in GRID:
        timeline = simulate(p, m, v)
        end = {(item.kind, item.microbatch, item.chunk * p + s): stop
               for s, row in enumerate(timeline.stages) for _, stop, item in row}
        last = p * v - 1
        for s, row in enumerate(timeline.stages):
            for start, _, item in row:
                vs = item.chunk * p + s
                needs = ([(FORWARD, item.microbatch, vs - 1)] if item.kind == FORWARD and vs else [])
                if item.kind == BACKWARD:
                    needs = [(FORWARD, item.microbatch, vs)] + ([(BACKWARD, item.microbatch, vs + 1)] if vs < last
                                                                else [])
                assert all(end[n] <= start for n in needs), (p, m, v, s, item)


def test_stage_one_twice_as_slow():
    """p=2, 1F1B; every item takes 1 on stage 0 and 2 on stage 1. By hand: stage 0 runs F0 in [0,1]; from t=1
    stage 1 never waits (stage 0 sends F(j) one unit after stage 1 returns B(j-2), three units before stage 1 needs
    it), so stage 1 is busy 4m from t=1 to 1+4m; stage 0's last backward B(m-1) then runs [1+4m, 2+4m].
    Makespan 4m+2; stage 0 busy 2m, idle 2m+2; stage 1 idle 2 (t in [0,1] and the last unit)."""
    slow = lambda stage, item: 2 if stage == 1 else 1  # noqa: E731
    for m in (1, 2, 4, 7):
        timeline = simulate(2, m, durations=slow)
        assert timeline.makespan == 4 * m + 2
        assert idle_fractions(timeline) == pytest.approx([(2 * m + 2) / (4 * m + 2), 2 / (4 * m + 2)])
        assert timeline.bubble_fraction() == pytest.approx((2 * m + 4) / (2 * (4 * m + 2)))
    spans = simulate(2, 2, durations=slow).stages  # m = 2 written out: makespan 10
    assert [(a, b, i.label()) for a, b, i in spans[0]] == [(0, 1, "F0"), (1, 2, "F1"), (5, 6, "B0"), (9, 10, "B1")]
    assert [(a, b, i.label()) for a, b, i in spans[1]] == [(1, 3, "F0"), (3, 5, "B0"), (5, 7, "F1"), (7, 9, "B1")]
    with pytest.raises(ValueError, match="unit durations"):
        simulate(2, 2, durations=slow).cells()


def test_fractional_durations():
    # backward twice the forward on every stage: the bubble is still (p - 1) / (m + p - 1) of wall time
    timeline = simulate(4, 8, durations=lambda s, item: 0.5 if item.kind == FORWARD else 1.0)
    assert Fraction(timeline.bubble_fraction()).limit_denominator(1000) == Fraction(3, 11)


def test_bound_is_quick():
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"bounded to 2,000,000 work items; p x m x v x 2 = 2 x 100000000 x 1"):
        simulate(2, 100_000_000)
    with pytest.raises(ConfigError, match="bounded"):
        stage_order(2, 0, 100_000_000)
    assert time.perf_counter() - start < 0.1
    check(2, MAX_ITEMS // 4)  # exactly at the bound is allowed


def test_a_chart_wider_than_it_can_print_is_refused_at_once():
    """99,999 stages of 4 micro-batches are 800k work items (within the bound) but a chart of 99,999 rows by a clock
    of 2 x (4 + 99,998) cells: 20 billion cells, refused before any is made."""
    start = time.perf_counter()
    with pytest.raises(ConfigError, match=r"bounded to 4,000,000 cells; stages x clock = 99999 x 2 x \(1 x 4 \+ "
                                          r"99999 - 1\) = 20,000,199,996"):
        check_chart(99_999, 4)
    assert time.perf_counter() - start < 0.1
    check_chart(1_000, 1_000)  # 1,000 x 3,998 cells


@pytest.mark.parametrize("p,m,v,match", [
    (0, 4, 1, "pipeline size must be >= 1"), (2, 0, 1, "micro-batches must be >= 1"),
    (2, 4, 0, "virtual pipeline size must be >= 1"), (1, 4, 2, "needs a pipeline size >= 2"),
    (2, 3, 2, "multiple of the pipeline size"),
])
def test_bad_arguments(p, m, v, match):
    with pytest.raises(ConfigError, match=match):
        check(p, m, v)
    with pytest.raises(ConfigError, match=match):
        simulate(p, m, v)


def test_stage_outside_the_pipeline():
    with pytest.raises(ConfigError, match="stage 2 is outside a pipeline of 2"):
        stage_order(2, 2, 4)


def test_deadlock_is_reported(monkeypatch):
    import ledger.models.schedule as schedule

    real = schedule.stage_order

    def backward_first_on_stage_1(p, stage, m, v=1):
        order = real(p, stage, m, v)
        return order[1:2] + order[:1] + order[2:] if stage == 1 else order

    monkeypatch.setattr(schedule, "stage_order", backward_first_on_stage_1)
    with pytest.raises(ValueError, match=r"deadlocks: stages wait at item positions \[\d+, 0\]"):
        schedule.simulate(2, 4)

