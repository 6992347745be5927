"""moe.expert_row_counts_new_per_step: the SequentialMLP row counts each step meets for the first time, against the
time model's uniform routing (none after the first step). Counted by hand on a table; judged on two real H100 runs
(tests/fixtures/h100_moe_rows: unpadded, and padded to 128 rows); their routing made uniform, the row is ok; a real
tiny MoE run trained on this machine counts but is not judged (no cuBLAS on a CPU); a grouped-GEMM run records no rows
and has no row; malformed rows are bad input."""
from __future__ import annotations

import copy

import pytest

from common.arguments import parse_args
from common.errors import InputError
from common.events import StepRecord
from ledger.evidence.read import read_run
from ledger.evidence.steps import run_steps
from ledger.models.simulate.hardware import load_hardware
from ledger.models.simulate.simulation import simulate
from ledger.reconcile.expert_rows import METRIC, expert_rows, expert_rows_rows, new_counts
from ledger.reconcile.run import reconcile_evidence
from tests.support.recorded_runs import FIXTURES
from tests.support.training_runs import train

TINY_MOE = ("--nproc-per-node", "1", "--model", "tiny", "--num-layers", "2", "--micro-batch-size", "2",
            "--global-batch-size", "8", "--mock-data", "--num-experts", "4", "--moe-router-topk", "2",
            "--train-iters", "6")


def test_a_step_counts_the_distinct_row_counts_no_earlier_step_met():
    steps = [(1, {"0": [[3, 5], [5, 5]], "1": [[5, 7]]}),  # 3, 5, 7: three new
             (2, {"0": [[3, 9]], "1": [[9, 9]]}),  # 9 new; 3 met in step 1
             (3, {"0": [[9, 3]], "1": [[7, 5]]})]  # all met
    assert new_counts(steps) == {1: 3, 2: 1, 3: 0}


def test_the_unpadded_h100_run_meets_62_new_counts_a_step_and_padding_to_128_meets_none():
    """The padded run's counts are multiples of 128: after its first steps it meets none, and its step is 31 ms
    shorter (472 -> 441 ms, the same time model for both: 419 ms)."""
    unpadded, padded = (rows_of(read_run(FIXTURES / "h100_moe_rows" / name)) for name in ("none", "128"))
    assert [(r.measured, r.verdict) for r in unpadded] == [(62, "off")]
    assert "worst step 2: 97, step 1: 117" in unpadded[0].explanation
    assert [(r.measured, r.verdict) for r in padded] == [(0, "ok")]


@pytest.fixture(scope="module")
def tiny_moe_run(tmp_path_factory):
    return train(tmp_path_factory.mktemp("moe") / "run", *TINY_MOE)


def rows_of(ev):
    return expert_rows_rows(ev, run_steps(ev))


@pytest.mark.slow
def test_a_cpu_run_counts_its_new_counts_but_is_not_judged(tiny_moe_run):
    """A real tiny MoE run on this machine: its router's counts move every micro-batch, so its steps meet new counts,
    but a CPU rank chooses no cuBLAS kernel: measured, n/a, and the explanation says why."""
    ev = read_run(tiny_moe_run)
    (found,) = [r for r in reconcile_evidence(ev).rows if r.metric == METRIC]
    assert found.predicted is None and found.measured >= 2 and found.verdict == "n/a"
    assert "not judged on a CPU rank" in found.explanation


def test_uniform_routing_meets_no_new_count_after_the_first_step():
    """The unpadded H100 run with every forward at T k / E = 8,192 / 8 = 1,024 rows an expert, as the time model
    routes: its steady steps meet none, ok."""
    ev = read_run(FIXTURES / "h100_moe_rows" / "none")
    for r in ev.ranks.values():
        for s in r.steps:
            s.moe_expert_rows = {layer: [[1024] * 8 for _ in forwards] for layer, forwards in s.moe_expert_rows.items()}
    (found,) = rows_of(ev)
    assert found.measured == 0 and found.verdict == "ok"


@pytest.mark.slow
def test_grouped_experts_record_no_rows_and_get_no_row(tmp_path):
    ev = read_run(train(tmp_path / "grouped", *TINY_MOE[:-2], "--train-iters", "2", "--moe-grouped-gemm"))
    assert all(s.moe_expert_rows is None for r in ev.ranks.values() for s in r.steps)
    assert rows_of(ev) == []


@pytest.mark.parametrize("flags, noted", [((), True), (("--moe-grouped-gemm",), False),
                                          (("--moe-pad-expert-rows", "128"), False),
                                          (("--moe-pad-expert-rows", "8"), True)])
def test_a_sequential_prediction_says_its_routing_is_uniform_and_new_counts_unpriced(flags, noted):
    """simulate's notes (and reconcile's step-time row, which carries them): SequentialMLP at routed rows meets new
    counts the prediction does not price; grouped GEMMs (one kernel for every count) and rows padded to 128 do not."""
    cfg = parse_args(["--model", "mixtral-8x7b-2l", "--bf16", "--micro-batch-size", "1", "--global-batch-size", "8",
                      *flags], world_size=1)
    notes = simulate(cfg, load_hardware("H200")).step.notes
    assert any(n.startswith("SequentialMLP: every micro-batch routed uniformly") for n in notes) is noted


@pytest.mark.parametrize("bad", [{"0": 3}, {"0": [[1, -2]]}, {"0": [["a"]]}, [1, 2]])
def test_malformed_rows_are_bad_input_naming_the_step(bad, tmp_path):
    record = StepRecord(step=4, moe_expert_rows=copy.deepcopy(bad))
    with pytest.raises(InputError, match="step 4: moe_expert_rows"):
        expert_rows(record, tmp_path / "events.jsonl")
