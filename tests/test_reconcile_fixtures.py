"""Reconcile's measurement claims, tested on recorded runs (not on figures built from the ledger's own formulas).

Fixtures (tests/fixtures/):
  gpu_h200_llama1b_l2   one H200, llama3.2-1b cut to 2 layers, profiler steps 3-4 on rank 0 (recorded before the
                        probes flagged profiled steps: the ledger falls back to the config's window)
  gloo_pp2              `train-ledger train --nproc-per-node 2 --model tiny --num-layers 2 --bf16
                        --pipeline-model-parallel-size 2 --global-batch-size 4 --micro-batch-size 1 --train-iters 9
                        --timers --bandwidth-sweep --use-pytorch-profiler --profile-step-start 3
                        --profile-step-end 4 --profile-ranks 0`, on CPU (gloo)
  gloo_dp2_overlap      the same with DP2 instead of PP2: --use-distributed-optimizer --overlap-grad-reduce
                        --overlap-param-gather --ddp-bucket-size 40000
  h200_pp2_p2p_slice    the point-to-point events of a real 2-H200 PP2 trace (its README says what was kept)
  gloo_dp2_sweeps       `train-ledger train --nproc-per-node 2 --model tiny --num-layers 2 --global-batch-size 4
                        --micro-batch-size 1 --train-iters 7 --use-distributed-optimizer --overlap-grad-reduce
                        --overlap-param-gather --ddp-bucket-size 40000 --timers --compute-sweep --bandwidth-sweep
                        --use-pytorch-profiler --profile-step-start 4 --profile-step-end 5 --profile-ranks 0` on CPU
                        (gloo, OMP_NUM_THREADS=1): with both sweeps, so the time model predicts; rank 0's trace export
                        stalled rank 1's step 7 by about a second
"""
from __future__ import annotations

import gzip
import json
import shutil
from statistics import median

import pytest

from common.config import RunConfig
from common.intervals import covered
from ledger.evidence.read import read_run
from ledger.evidence.steps import FROM_CONFIG, FROM_RECORDS
from ledger.evidence.traces import summarize
from ledger.reconcile.comm import predicted_volume, trace_volume
from ledger.reconcile.overlap import timer_exposed, timer_intervals
from ledger.reconcile.run import reconcile, run_steps
from tests.support.recorded_runs import FIXTURES, only


@pytest.fixture(scope="module")
def pp2(tmp_path_factory):
    return reconciled(tmp_path_factory, "gloo_pp2")


@pytest.fixture(scope="module")
def dp2(tmp_path_factory):
    return reconciled(tmp_path_factory, "gloo_dp2_overlap")


@pytest.fixture(scope="module")
def h200(tmp_path_factory):
    return reconciled(tmp_path_factory, "gpu_h200_llama1b_l2")


def reconciled(factory, name: str):
    run = factory.mktemp(name) / "run"
    shutil.copytree(FIXTURES / name, run)
    return run, reconcile(run)


def test_a_step_stalled_by_another_ranks_trace_export_is_left_out_of_the_pipeline_rows(tmp_path):
    # Rank 1 waited ~986 ms in step 7's first forward for rank 0, which was writing its trace: with that step in,
    # rank 1's mean forward is ~140 ms and its backward/forward ratio reads 0.05 (seen before the fix).
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "gloo_dp2_sweeps", run)
    result = reconcile(run)
    ratio = only(result, "pipeline.backward_over_forward", rank=1)
    assert 0.3 < ratio.measured < 4, ratio
    assert 7 not in run_steps(read_run(run)).steady(range(1, 8))


def test_p2p_bytes_from_the_gloo_trace_equal_the_formula_and_the_engines_counters(pp2):
    run, result = pp2
    # Stage 0 of 2 with 4 micro-batches sends 4 activations and receives 4 gradients of [s, b, h] = [32, 1, 64] bf16
    p2p = only(result, "comm.pp.send_recv.bytes_per_step", rank=0)  # point-to-point is the pipeline's
    assert p2p.source == "trace"
    assert p2p.measured == p2p.predicted == p2p.inventory == 8 * 32 * 1 * 64 * 2
    summary = summarize(next((run / "traces").glob("rank0.*")))
    assert {(p.op, p.elements) for p in summary.p2p} == {("send", 32 * 64), ("recv", 32 * 64)}


def test_p2p_bytes_of_the_real_h200_pp2_trace_are_the_formulas(tmp_path):
    # The evidence run's shape: llama3.2-1b, seq 4096, micro-batch 1, bf16, 8 micro-batches. NCCL's SendRecv kernels
    # carry no size; the c10d send/recv ops' dims do: 8 sends + 8 receives of 4096 x 1 x 2048 bf16 per step.
    slice_dir = FIXTURES / "h200_pp2_p2p_slice"
    cfg = RunConfig.from_dict(json.loads((slice_dir / "manifest.json").read_text())["config"])
    expected = 2 * 8 * 4096 * 1 * 2048 * 2
    assert expected == 268_435_456
    for rank in (0, 1):
        path = tmp_path / f"rank{rank}.json"
        path.write_text(gzip.decompress((slice_dir / f"rank{rank}.json.gz").read_bytes()).decode())
        summary = summarize(path)
        assert not any(c.bytes for c in summary.collectives)  # the kernels say nothing of the size
        measured = trace_volume(summary, {"tp": (rank,), "dp": (rank,), "pp": (0, 1)}, 2)
        assert measured[("pp", "send_recv")] == expected == predicted_volume(cfg, rank)[("pp", "send_recv")]


def test_the_probes_flag_profiled_steps_and_the_step_after_the_trace_export(dp2):
    run, _ = dp2
    ev = read_run(run)
    flags = {rank: {s.step: (s.profiled, s.after_trace_export) for s in r.steps}
             for rank, r in ev.ranks.items()}
    # rank 0 profiled steps 3-4 plus the extra step HTA drops (5); rank 1 was not profiled
    assert [s for s, (p, _) in flags[0].items() if p] == [3, 4, 5] and not any(p for p, _ in flags[1].values())
    # both ranks flag step 6: rank 0 wrote its trace at the end of step 5, and rank 1 waited for it in step 6
    assert all([s for s, (_, a) in f.items() if a] == [6] for f in flags.values())
    selection = run_steps(ev)
    assert selection.source == FROM_RECORDS and selection.steady(range(1, 10)) == [2, 7, 8, 9]


def test_throughput_judges_only_steady_steps_and_reports_the_profilers_cost(dp2):
    run, result = dp2
    ev = read_run(run)
    times = {(rank, s.step): s.step_time_s for rank, r in ev.ranks.items() for s in r.steps}
    spread = only(result, "throughput.step_time_spread")
    assert spread.step in (2, 7, 8, 9)
    # the trace export (rank 0) made rank 1 wait in step 6: the widest spread of the run, reported, not judged
    profiled = only(result, "throughput.step_time_spread_profiled")
    assert profiled.step == 6 and profiled.verdict == "n/a" and profiled.measured > spread.measured
    steady = [t for (_, step), t in times.items() if step in (2, 7, 8, 9)]
    in_window = [t for (_, step), t in times.items() if step in (3, 4, 5)]
    overhead = only(result, "throughput.profiler_overhead")
    assert overhead.measured == pytest.approx(median(in_window) / median(steady) - 1)
    assert only(result, "throughput.step_time").measured == pytest.approx(median(steady))


def test_a_stall_on_the_param_all_gather_is_not_counted_as_its_overlap(dp2):
    # The DDP pre-hook's wait is a "dp-wait" range nested in the forward range; compute excludes it, so the part of
    # an all-gather that the forward spent waiting for is exposed, never overlapped.
    run, _ = dp2
    for r in read_run(run).ranks.values():
        forwards = [t for t in r.timing if t.category == "forward"]
        waits = [t for t in r.timing if t.category == "dp-wait"]
        assert waits and all(any(f.step == w.step and f.start_s <= w.start_s <= w.end_s <= f.end_s
                                 for f in forwards) for w in waits)
        gathers = {(t.step, t.bucket): (t.t_start, t.t_end) for t in r.timing
                   if t.category == "dp-comm" and t.name.startswith("all-gather")}
        for i in timer_intervals(r):
            if i.op != "all_gather":
                continue
            span = gathers[(i.step, i.bucket)]
            stalled = sum(covered(span, [(w.t_start, w.t_end)]) for w in waits if w.bucket == i.bucket)
            assert i.overlapped <= i.duration - stalled + 1e-6


def test_exposed_dp_comm_is_a_union_no_larger_than_the_buckets_tails(dp2):
    run, result = dp2
    ev = read_run(run)
    r = ev.ranks[1]  # no trace on rank 1: its per-step figure comes from the timers
    steps = run_steps(ev).steady({t.step for t in r.timing})
    union = timer_exposed(r, steps)
    intervals = timer_intervals(r)
    tails = {step: sum(i.exposed for i in intervals if i.step == step) for step in steps}
    assert all(union[step]["dp"] <= tails[step] + 1e-9 for step in steps)
    assert sum(union[s]["dp"] for s in steps) < sum(tails.values())  # finalize waits the buckets in sequence
    row = only(result, "overlap.exposed_dp_comm_per_step", rank=1)
    assert row.source == "timers" and "upper bound" in row.explanation
    assert row.measured == pytest.approx(sum(union[s]["dp"] for s in steps) / len(steps))
    assert not [x for x in result.rows if x.metric == "overlap.exposed_dp_comm_per_step" and x.rank == 0
                and x.source == "timers"]  # rank 0 has a trace: its figure is the trace's


def test_the_real_h200_run_leaves_the_profiled_steps_out_from_its_config(h200):
    run, result = h200
    ev = read_run(run)
    selection = run_steps(ev)
    assert selection.source == FROM_CONFIG  # recorded before the probes flagged profiled steps
    # torch.profiler on steps 3-4 and one more for HTA; a world of one waits for nobody's trace export
    assert selection.profiled == {3, 4, 5} and not selection.after_export
    times = {s.step: s.step_time_s for s in ev.ranks[0].steps}
    overhead = only(result, "throughput.profiler_overhead")
    assert overhead.measured == pytest.approx(median([times[3], times[4], times[5]]) / median([times[2], times[6]])
                                              - 1)
    assert overhead.measured > 0.2  # the profiler's own cost on a real GPU step
    assert not [r for r in result.rows if r.metric == "throughput.step_time_vs_other_ranks"]  # nobody to compare


def test_identity_rows_are_not_counted_as_agreement(h200):
    _, result = h200
    identity = {r.metric for r in result.rows if r.verdict == "identity"}
    assert identity == {"memory.device_total", "throughput.tokens_per_step"}
    counts = result.verdict_counts()
    assert counts["identity"] == 2 and counts["ok"] == sum(r.verdict == "ok" for r in result.rows)
