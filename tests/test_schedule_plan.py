"""The schedule plan (pure) and `train-ledger schedule`.

Specification: each stage forwards and backwards every (micro-batch, chunk) exactly once, forward first; the order is
Megatron's (1F1B warmup min(p - i - 1, m); interleaved chunk order, docs/engine.md); the plan's P2P exchanges pair up
between neighbours without deadlock. `train-ledger schedule` charts the ledger's own derivation of the order
(ledger/models/schedule.py, held equal to this plan in tests/test_ledger_schedule.py) and its bubble is (p - 1) / (V m +
p - 1).
"""
from __future__ import annotations

import json
from collections import Counter

import pytest

from cli.main import main as cli
from common.errors import ConfigError
from engine.pipeline_parallel.schedule_plan import BACKWARD, FORWARD, StagePlan, stage_plan

GRID = [(p, m, v) for p in range(1, 7) for v in (1, 2, 3) for m in range(1, 13) if v == 1 or (p > 1 and m % p == 0)]


def schedule_plan(p: int, m: int, v: int = 1, forward_only: bool = False) -> list[StagePlan]:
    """Every stage's plan, as the stages' schedules each build their own."""
    return [stage_plan(p, stage, m, v, forward_only) for stage in range(p)]


def labels(p, m, v=1):
    return [[item.label(v > 1) for item in plan.items] for plan in schedule_plan(p, m, v)]


def test_reference_1f1b_p2_m8_stage0_warms_up_with_one_forward_stage1_with_none():
    stage0, stage1 = labels(2, 8)
    assert stage0 == ["F0", "F1", "B0", "F2", "B1", "F3", "B2", "F4", "B3", "F5", "B4", "F6", "B5", "F7", "B6", "B7"]
    assert stage1 == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "F4", "B4", "F5", "B5", "F6", "B6", "F7", "B7"]


def test_1f1b_warmup_is_min_of_stages_after_and_microbatches():
    for p, m in [(4, 8), (4, 2), (8, 3)]:
        assert [plan.num_warmup for plan in schedule_plan(p, m)] == [min(p - i - 1, m) for i in range(p)]


def test_interleaved_order_p2_v2_m4_follows_megatrons_chunk_rule():
    """k-th forward: micro-batch (k // pV) * p + k % p on chunk (k % pV) // p; backwards walk the chunks in
    reverse. Warmup 2 (p - i - 1) + (V - 1) p: 4 on stage 0, 2 on stage 1."""
    stage0, stage1 = labels(2, 4, 2)
    assert stage0 == ["F0c0", "F1c0", "F0c1", "F1c1",
                      "F2c0", "B0c1", "F3c0", "B1c1", "F2c1", "B0c0", "F3c1", "B1c0",
                      "B2c1", "B3c1", "B2c0", "B3c0"]
    assert stage1 == ["F0c0", "F1c0",
                      "F0c1", "B0c1", "F1c1", "B1c1", "F2c0", "B0c0", "F3c0", "B1c0", "F2c1", "B2c1", "F3c1", "B3c1",
                      "B2c0", "B3c0"]


def test_interleaved_with_as_many_microbatches_as_stages_runs_all_forwards_first():
    for plan in schedule_plan(4, 4, 2):
        kinds = [item.kind for item in plan.items]
        assert kinds == [FORWARD] * 8 + [BACKWARD] * 8


@pytest.mark.parametrize("p,m,v", GRID)
def test_every_microbatch_forwarded_then_backwarded_once_per_chunk(p, m, v):
    for plan in schedule_plan(p, m, v):
        seen = {}
        for position, item in enumerate(plan.items):
            seen.setdefault((item.microbatch, item.chunk), []).append((item.kind, position))
        assert sorted(seen) == [(mb, c) for mb in range(m) for c in range(v)]
        for work in seen.values():
            assert [kind for kind, _ in work] == [FORWARD, BACKWARD]


def _p2p_calls(plan, p):
    """The plan's exchanges as lists of (op, (src, dst, kind)), in the communicator's posting order."""
    s, calls = plan.stage, []
    for ex in [plan.first_exchange] + [step.exchange for step in plan.steps]:
        ops = [("send", (s, (s + 1) % p, FORWARD))] * ex.send_forward
        ops += [("recv", ((s - 1) % p, s, FORWARD))] * ex.recv_forward
        ops += [("send", (s, (s - 1) % p, BACKWARD))] * ex.send_backward
        ops += [("recv", ((s + 1) % p, s, BACKWARD))] * ex.recv_backward
        if ops:
            calls.append(ops)
    return calls


def _numbered(calls):
    """Tag each op with its index on its channel: the n-th send on a channel meets the n-th receive."""
    count: Counter = Counter()
    numbered = []
    for call in calls:
        numbered.append([])
        for op, channel in call:
            numbered[-1].append((op, channel, count[(op, channel)]))
            count[(op, channel)] += 1
    return numbered


def _completes(plans) -> bool:
    """Replay the exchanges where a call returns only once every op in it has met its peer's op (the strictest
    reading of batch_isend_irecv + wait): True when every rank gets through all its calls."""
    p = len(plans)
    numbered = [_numbered(_p2p_calls(plan, p)) for plan in plans]
    position = [0] * p
    while any(position[r] < len(numbered[r]) for r in range(p)):
        posted = {op for r in range(p) for call in numbered[r][:position[r] + 1] for op in call}
        moved = False
        for r in range(p):
            if position[r] < len(numbered[r]) and all(
                    ({"send": "recv", "recv": "send"}[op], ch, n) in posted for op, ch, n in numbered[r][position[r]]):
                position[r] += 1
                moved = True
        if not moved:
            return False
    return True


@pytest.mark.parametrize("p,m,v", [g for g in GRID if g[0] > 1])
def test_p2p_exchanges_pair_up_in_order_and_never_deadlock(p, m, v):
    for forward_only in (False, True):
        plans = schedule_plan(p, m, v, forward_only)
        sent: dict = {}
        received: dict = {}
        for plan in plans:
            for call in _p2p_calls(plan, p):
                for op, (src, dst, kind) in call:
                    (sent if op == "send" else received).setdefault((src, dst), []).append(kind)
        assert sent == received  # per pair, the same kinds in the same order: no tags needed
        assert _completes(plans)


def test_the_deadlock_replay_can_fail():
    """Exchanging between an interleaved steady forward and its backward (1F1B's pattern) deadlocks."""
    from dataclasses import replace

    from engine.pipeline_parallel.schedule_plan import Exchange, Step
    plans = schedule_plan(2, 4, 2)
    split = []
    for plan in plans:
        steps = []
        for step in plan.steps:
            if len(step.items) == 2:
                f, b = step.items
                steps += [Step((f,), Exchange(send_forward=step.exchange.send_forward, recv_backward=True)),
                          Step((b,), replace(step.exchange, send_forward=False, recv_backward=False))]
            else:
                steps.append(step)
        split.append(replace(plan, steps=steps))
    assert not _completes(split)


@pytest.mark.parametrize("args,problem", [
    ((0, 4, 1), "pipeline size"), ((2, 0, 1), "micro-batches"), ((2, 4, 0), "virtual pipeline size"),
    ((1, 4, 2), "pipeline size >= 2"), ((2, 3, 2), "multiple of the pipeline size")])
def test_bad_arguments_are_config_errors(args, problem):
    with pytest.raises(ConfigError, match=problem):
        p, m, v = args
        stage_plan(p, 0, m, v)


def test_cli_json_p2_m8(capsys):
    assert cli(["schedule", "--pp", "2", "--microbatches", "8", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [s["stage"] for s in out["stages"]] == [0, 1]
    assert out["stages"][0]["events"][:3] == ["F0", "F1", "B0"]
    assert out["stages"][1]["events"][:3] == ["F0", "B0", "F1"]
    assert out["clock"][0][:3] == ["F0", "F1", "."]
    assert out["clock"][1][:3] == [".", "F0", "B0"]
    assert len(out["clock"][0]) == 2 * (8 + 2 - 1)
    assert out["bubble_fraction"] == pytest.approx(1 / 9)
    assert out["analytic_bubble_fraction"] == pytest.approx(1 / 9)


def test_cli_text_interleaved_tags_chunks_and_names_the_convention(capsys):
    assert cli(["schedule", "--pp", "2", "--microbatches", "4", "--vpp", "2"]) == 0
    out = capsys.readouterr().out
    assert "stage 0 (warmup 4): F0c0 F1c0 F0c1 F1c1 F2c0 B0c1" in out
    assert "idle cells / all cells" in out
    assert "(p-1)/(V*m+p-1) = 1/9" in out


@pytest.mark.parametrize("argv", [["--pp", "2"], ["--pp", "x", "--microbatches", "2"],
                                  ["--pp", "2", "--microbatches", "3", "--vpp", "2"],
                                  ["--pp", "-1", "--microbatches", "2"]])
def test_cli_bad_input_is_one_line_and_status_2(capsys, argv):
    assert cli(["schedule", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert len(captured.err.strip().splitlines()) == 1
