"""The host sweep times an MoE model's backward pass at start-up (engine/probe_adapters.py pass_timer), on two real
H200 runs (tests/fixtures/h200_moe/pass_backward, held out): the host backward row is priced in the context of this
code on this host, measured, as a dense model's is; the forward is not timed (the dispatcher reads the counts, so the
forward waits for the device). The timed passes leave no trace in the step: their routing counts and the delayed
experts' held operands are dropped."""
from __future__ import annotations

from pathlib import Path

import pytest

from common.ops import host
from ledger.evidence.read import read_run
from tests.support.recorded_runs import FIXTURES, only, reconcile_recorded
from tests.support.records import copy_without

RUNS = FIXTURES / "h200_moe" / "pass_backward"
NAMES = ("pad16", "pad16_delayed")


def without_the_pass(run: Path, to: Path) -> Path:
    """The run as it would read had the sweep not timed the backward pass."""
    return copy_without(run, to, lambda e: e["kind"] == "host" and e["op"] == host.PASS_BACKWARD)


@pytest.mark.parametrize("name", NAMES)
def test_the_moe_backwards_host_is_priced_in_its_measured_context(name, tmp_path):
    """Measured 18.3 / 14.2 ms a micro-batch (padded / delayed); in the measured context 13.9 / 10.8 ms (-24%, the
    step's backward still takes longer than the pass alone); from the recipes alone 9.5 / 7.7 ms, about half."""
    swept = {record.op for record in read_run(RUNS / name).ranks[0].host}
    assert host.PASS_BACKWARD in swept and host.PASS_FORWARD not in swept
    in_context = only(reconcile_recorded(RUNS / name), "time.host_backward_per_microbatch", rank=0)
    recipes = only(reconcile_recorded(without_the_pass(RUNS / name, tmp_path / name)),
                   "time.host_backward_per_microbatch", rank=0)
    assert in_context.measured == recipes.measured
    assert abs(in_context.predicted / in_context.measured - 1) < 0.30
    assert recipes.predicted / recipes.measured - 1 < -0.35


def test_the_timed_passes_leave_no_routing_counts_and_no_held_operands():
    """Step 1 routes the step's own 8 x 4,096 x 2 assignments a layer, and the delayed run's first step is the one
    recorded before the pass timer (h200_moe/delayed_wgrad/pad16_delayed, the same flags and seed): the same loss,
    the grad norm to bf16's run-to-run noise (five passes' held operands would have added their gradients)."""
    runs = {name: read_run(RUNS / name) for name in NAMES}
    for ev in runs.values():
        first = ev.ranks[0].steps[0]
        assert [sum(c) for c in first.moe_tokens_per_expert.values()] == [8 * 4096 * 2] * 2
    before = read_run(FIXTURES / "h200_moe" / "delayed_wgrad" / "pad16_delayed").ranks[0].steps[0]
    after = runs["pad16_delayed"].ranks[0].steps[0]
    assert after.loss == before.loss
    assert after.grad_norm == pytest.approx(before.grad_norm, rel=1e-5)
