"""The reconciliation's mixture-of-experts rows (ledger/reconcile/moe.py) and the memory rows of an MoE run.

Plumbing on synthetic evidence built in memory (tests/support/moe_evidence.py: a 2-rank EP2 run with a hand-made
routing table and the ranges the engine writes for it); expectations are derived by hand. Claims about real runs are
tested on real runs: tests/test_moe_calibration.py (a gloo EP2 run), tests/test_h200_moe_claims.py (an H200 run).
Every judged row type gets its can-be-off case: the same evidence with a wrong measurement is "off".
"""
from __future__ import annotations

import copy

import pytest

from common.arguments import parse_args
from common.errors import InputError
from ledger.evidence.run import RunEvidence
from ledger.evidence.steps import run_steps
from ledger.reconcile.memory import memory_rows
from ledger.reconcile.moe import moe_rows
from ledger.reconcile.rows import Row
from ledger.reconcile.run import reconcile_evidence
from tests.support.moe_evidence import PREDICTED_S, ROW, evidence, model


def rows_of(ev: RunEvidence, with_fit: bool = True) -> list[Row]:
    return moe_rows(ev, model(with_fit), run_steps(ev))


def pick(rows: list[Row], metric: str, rank: int | None = 0) -> Row:
    (found,) = [r for r in rows if r.metric == metric and r.rank == rank]
    return found


def test_the_volume_predicted_from_the_routing_matches_the_ranges():
    rows = rows_of(evidence())
    size, remote = (pick(rows, m) for m in ("moe.all_to_all.bytes_per_step", "moe.all_to_all.remote_bytes_per_step"))
    # rank 0, 4 layers: 2 (64 + 82) rows of size, 2 (32 + 50) remote
    assert size.predicted == 4 * 2 * (64 + 82) * ROW and remote.predicted == 4 * 2 * (32 + 50) * ROW
    assert (size.verdict, remote.verdict) == ("ok", "ok")
    assert pick(rows, "moe.all_to_all.bytes_per_step", 1).predicted == 4 * 2 * (64 + 46) * ROW


def test_dropped_assignments_are_not_sent():
    rows = rows_of(evidence(dropped={1: [2, 0, 0, 0]}))
    assert pick(rows, "moe.all_to_all.remote_bytes_per_step", 1).predicted == 4 * 2 * (48 + 32) * ROW
    assert all(r.verdict == "ok" for r in rows if r.metric.startswith("moe.all_to_all"))
    dropped = pick(rows, "moe.dropped_tokens_per_step", 1)
    assert (dropped.measured, dropped.verdict) == (4 * 2, "n/a")


@pytest.mark.parametrize("field", ["bytes", "remote_bytes"])
def test_a_wrong_volume_is_off(field):
    ev = evidence()
    for t in ev.ranks[0].timing:
        if "counts" not in t.name:
            setattr(t, field, int(getattr(t, field) * 1.1))
    metric = "moe.all_to_all.bytes_per_step" if field == "bytes" else "moe.all_to_all.remote_bytes_per_step"
    assert pick(rows_of(ev), metric).verdict == "off"


def test_the_all_to_all_time_is_predicted_from_the_volume_and_the_link_fit():
    r = pick(rows_of(evidence()), "time.ep_all_to_all_per_step")
    assert r.predicted == pytest.approx(PREDICTED_S) and r.measured == pytest.approx(PREDICTED_S)
    assert r.verdict == "ok" and "exposed" in r.explanation


def test_a_wrong_all_to_all_time_is_off():
    ev = copy.deepcopy(evidence())
    for t in ev.ranks[0].timing:
        t.duration_s *= 3  # 7.3 ms over the prediction: beyond 3 x (25% or 2 ms)
    assert pick(rows_of(ev), "time.ep_all_to_all_per_step").verdict == "off"


def test_without_an_all_to_all_sweep_the_time_row_says_why():
    r = pick(rows_of(evidence(), with_fit=False), "time.ep_all_to_all_per_step")
    assert (r.predicted, r.verdict) == (None, "n/a")
    assert "no bandwidth sweep of all_to_all on the ep group" in r.explanation


def test_load_imbalance_is_shown_per_layer_with_the_tokens_per_expert():
    r = pick(rows_of(evidence()), "moe.load_imbalance.layer0", rank=None)
    # over both routers and three steps: 3 x [50, 32, 26, 20], mean 3 x 32
    assert r.measured == pytest.approx(50 / 32) and r.verdict == "n/a"
    assert "[150, 96, 78, 60]" in r.explanation


def test_a_dense_run_has_no_moe_rows():
    ev = evidence()
    ev.config = parse_args(["--model", "tiny", "--world-size", "2"])
    assert rows_of(ev) == []


def test_the_static_memory_rows_count_the_expert_buffers():
    # fp32, DDP (16 B a parameter: param, grad, Adam m, v): dense 4 x (12,288 + 128 + 256) + 64,000 + 64 = 114,752;
    # this rank's 2 experts of 33,792 a layer: 270,336
    rows = [r for r in memory_rows(evidence()) if r.metric == "memory.static_after_first_step"]
    assert {r.predicted for r in rows} == {16 * (114_752 + 270_336)}


def test_a_reconciliation_of_an_moe_run_carries_the_rows_and_replays_the_step_when_calibrated():
    result = reconcile_evidence(evidence())
    metrics = {r.metric for r in result.rows}
    assert {"moe.all_to_all.bytes_per_step", "time.ep_all_to_all_per_step", "moe.load_imbalance.layer3"} <= metrics
    # the step replay prices MoE layers (tests/test_moe_time_model.py); this evidence has no sweeps, so it says that
    assert any("no compute sweep records" in line for line in result.missing)
    assert not any("expert kernels" in line for line in result.missing)


@pytest.mark.parametrize("bad", [{"0": [1, 2, 3]}, {"0": "many"}, {"0": [1, -2, 3, 4]}])
def test_malformed_routing_counts_are_bad_input_naming_the_file(bad):
    ev = evidence()
    ev.ranks[1].steps[0].moe_tokens_per_expert = bad
    with pytest.raises(InputError, match="rank1.*moe_tokens_per_expert"):
        rows_of(ev)


def test_the_dashboards_params_term_leaves_out_both_buffers_padding():
    """The memory waterfall's params and grads exclude padding (shown as its own term): the expert buffer's too. A
    width of 72 and experts of 99 put the params off the 64-element alignment, so both buffers are padded."""
    from ledger.models.formulas.buffer_layout import expert_rank_buffers, rank_buffers
    from ledger.present.dashboard_data import _predicted_terms

    cfg = parse_args(["--model", "tiny", "--hidden-size", "72", "--num-experts", "4", "--moe-ffn-hidden-size", "99",
                      "--expert-model-parallel-size", "2", "--use-distributed-optimizer", "--bf16",
                      "--global-batch-size", "4"], world_size=4)
    dense, expert = rank_buffers(cfg, 0), expert_rank_buffers(cfg, 0)
    assert all(b.padding > 0 for b in dense + expert)
    terms, experts = _predicted_terms(cfg, {"tp": 0, "pp": 0, "dp": 0})
    real = sum(b.numel_unpadded for b in dense + expert)
    assert (terms["params"], terms["grads"]) == (real * 2, real * 4)  # bf16 params, fp32 grads
    assert terms["padding"] == sum(b.padding for b in dense + expert) * (2 + 4)
    expert_real = sum(b.numel_unpadded for b in expert)  # the expert part alone, shown apart on the page
    assert (experts["params"], experts["padding"]) == (expert_real * 2, sum(b.padding for b in expert) * 6)
