"""Five shapes of parts no committed GPU run had exercised (runs/bench/new_shapes.py --set coverage: core attention
filling the step at seq 16,384, head dim 128 on a small model, 16 grouped experts of width 3,584 at top 4, a
launch-bound shape under CUDA graphs, multi-head attention without query groups at hidden 2048), predicted from
config and the H200 file before one H200 ran them (the predictions committed in ab84a75,
runs/bench/results/2026-12-05_coverage_shapes_predictions.txt; the runs are tests/fixtures/h200_coverage_shapes, 12
steps each with --all-probes and a profiled step 9, BENCHMARKS.md 2026-12-05, second entry). Nothing in the time model
changed after; the replay's reading of their traces did (docs/formulas.md, "Execution graph": a sync cannot wait for
work that ended after it returned), which moves no prediction."""
from __future__ import annotations

import pytest

from ledger.evidence.exec_graph import read_graph
from ledger.evidence.read import read_run
from ledger.evidence.replay import replay
from ledger.models.simulate.simulation import simulate
from ledger.reconcile.step_decomposition import CLASS_METRIC
from ledger.reconcile.validation import Validation, validate_run
from tests.support.recorded_runs import FIXTURES, reconcile_recorded
from tests.support.short_attention import without_short_attention

RUNS = FIXTURES / "h200_coverage_shapes"
WITHIN = ("cv_h1024_l4_s16384", "cv_hd128_l4_s8192", "cv_mha_h2048_l8_s2048")
MISSED = ("cv_lb_h768_l8_s256_graphed", "cv_moe_e16_top4_grouped")
GRAPHED, GROUPED = MISSED


@pytest.fixture(scope="module")
def validation() -> dict[str, Validation]:
    """Each run judged once (a module fixture keeps the file on one test worker)."""
    return {name: validate_run(RUNS / name, "H200") for name in WITHIN + MISSED}


@pytest.mark.parametrize("name", WITHIN)
def test_three_land_within_three_percent_of_their_step(validation, name):
    # -2.3% (seq 16,384), -0.1% (head dim 128), +2.6% (multi-head attention, vocabulary 50,304)
    assert abs(validation[name].errors()["step_time"]) < 0.03


def test_the_graphed_launch_bound_step_lands_within_two_percent_once_short_attention_has_its_own_curves(validation):
    # Predicted -6.6% before it ran, with flash attention at seq 256 priced at seq 2048's efficiency (a tenth of its
    # time); -1.8% from the file since the short-sequence grid (hardware_sweep.py --short-attention, 2026-12-05),
    # which never saw this run.
    assert -0.025 < validation[GRAPHED].errors()["step_time"] < -0.01
    before = simulate(read_run(RUNS / GRAPHED).config, without_short_attention()).step.step_time
    assert -0.075 < before / validation[GRAPHED].measured.step_time - 1 < -0.055


def test_the_16_expert_step_is_predicted_five_percent_short_with_its_grouped_gemms_at_their_measured_slowdown(
        validation):
    # -6.7% as predicted before the run (the grouped GEMMs at the dense GEMM's price); -5.2% since the H200 file
    # prices them at the slowdown a side-by-side kernel timing of mixtral's expert shape measured (x1.09: runs/bench/
    # grouped_gemm_slowdown.py; this run's 16 experts of width 3,584 were not in it). Still a miss: the file's host
    # block gives 41% of its host forward issue (per-expert wgrads and 16 groups a layer).
    assert -0.06 < validation[GROUPED].errors()["step_time"] < -0.05


@pytest.mark.parametrize("name", WITHIN + MISSED)
def test_every_peak_lands_within_a_quarter_of_one_percent(validation, name):
    assert abs(validation[name].errors()["peak_bytes"]) < 0.0025


def test_the_16_expert_steps_replay_within_a_tenth_of_one_percent_without_a_wait_its_trace_cannot_name():
    # Each layer's backward on the autograd thread waits (cudaEventSynchronize) for the counts its forward copied on
    # the main thread. Taken as a wait for the autograd thread's own last kernel, the replay ran 13-15% long.
    graph = read_graph(RUNS / "cv_moe_e16_top4_grouped/traces/rank0.step9-9.json.gz")
    event_syncs = [s for s in graph.syncs if s.kind == "event" and s.call.thread != graph.steps[9].thread]
    assert len(event_syncs) == 32 and all(not s.awaited for s in event_syncs)
    assert all(abs(s.error) < 0.001 for s in replay([graph]).steps)


@pytest.mark.parametrize("name", ("cv_h1024_l4_s16384", "cv_hd128_l4_s8192"))
def test_core_attention_runs_slower_in_the_attention_heavy_steps_than_one_power_factor_says(name):
    # A finding stated, not a goal met: at one power-limit factor for every class (x1.077 and x1.134 here), the
    # profiled steps' cuDNN flash kernels ran 8-14% over their model while the GEMMs ran 0-3% under it (seq 16,384:
    # forward x1.22, backward x1.18 their isolated sweep times, the GEMMs x1.05). A per-class slowdown that fixes
    # it moves these bounds (BENCHMARKS.md 2026-12-05, second entry).
    rows = [r for r in reconcile_recorded(RUNS / name).rows if r.metric.startswith(CLASS_METRIC)]
    ratio = {cls: [r.measured / r.predicted for r in rows if r.metric == CLASS_METRIC + cls] for cls in
             ("attention", "matmul")}
    assert len(ratio["attention"]) == len(ratio["matmul"]) == 2  # profiled steps 9 and 10
    assert all(1.06 < x < 1.16 for x in ratio["attention"])
    assert all(0.95 < x < 1.005 for x in ratio["matmul"])
