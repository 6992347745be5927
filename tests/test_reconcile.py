"""Reconciliation of synthetic runs whose every figure has a known answer (tests/fixtures/synthetic_run.py).

Plumbing: the synthetic "measurements" are built from the ledger's own formulas, so these tests show that rows are
wired and judged, not that a formula matches a machine (tests/test_reconcile_fixtures.py does that on recorded
runs)."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from cli.main import main as cli
from ledger.evidence.traces import normalize_op
from ledger.models.formulas.static_memory import owned_param_elements
from ledger.reconcile.rows import NOT_ON_CPU, judge, row
from ledger.reconcile.run import reconcile
from tests.fixtures.synthetic_run import Spec, make_run, write_trace


def rows_by(result, metric, **where):
    return [r for r in result.rows if r.metric == metric
            and all(getattr(r, k) == v for k, v in where.items())]


def one(result, metric, **where):
    found = rows_by(result, metric, **where)
    assert len(found) == 1, (metric, where, found)
    return found[0]


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    run, known = make_run(tmp_path_factory.mktemp("clean") / "run")
    return reconcile(run), known


def test_verdict_thresholds():
    assert judge(101.0, 100.0, 0.02)[2] == "ok"
    assert judge(105.0, 100.0, 0.02)[2] == "warn"
    assert judge(107.0, 100.0, 0.02)[2] == "off"
    assert judge(0.0, 0.0, 0.02)[2] == "ok"
    assert judge(1.0, 0.0, 0.02)[2] == "off"


def test_row_compares_inventory_with_prediction_when_nothing_is_measured():
    r = row("m", "rank", predicted=100.0, inventory=140.0, unit="bytes", tolerance=0.1, explanation="")
    assert (r.diff, r.verdict) == (40.0, "off")
    assert row("m", "rank", measured=5.0, unit="s", tolerance=0.1, explanation="").verdict == "n/a"


def test_bubble_matches_the_1f1b_formula_on_every_stage(clean):
    result, known = clean
    for stage in (0, 1):
        for r in rows_by(result, "pipeline.bubble_of_wall_time", stage=stage):
            assert r.measured == pytest.approx(known["bubble"]) == pytest.approx(0.2)
            assert r.verdict == "ok"
        for r in rows_by(result, "pipeline.bubble_relative_to_compute", stage=stage):
            assert r.measured == pytest.approx(0.25)


def test_backward_is_twice_forward(clean):
    result, _ = clean
    assert all(r.measured == pytest.approx(2.0) for r in rows_by(result, "pipeline.backward_over_forward"))


def test_bucket_overlap_from_timers_and_trace(clean, tmp_path):
    result, _ = clean
    untraced = reconcile(make_run(tmp_path / "run", Spec(traces=False))[0])
    for source, found in (("timers", untraced), ("trace", result)):
        b0 = one(found, "overlap.reduce_scatter.overlapped_fraction", rank=0, bucket=0, source=source)
        b1 = one(found, "overlap.reduce_scatter.overlapped_fraction", rank=0, bucket=1, source=source)
        assert (b0.measured, b0.predicted, b0.verdict) == (pytest.approx(1.0), 1.0, "ok")
        assert b1.measured == pytest.approx(0.5)
        assert b1.predicted is None  # the last bucket has nothing left to hide behind
        exposed = one(found, "overlap.exposed_dp_comm_per_step", rank=0, source=source)
        assert exposed.measured == pytest.approx(0.5e-3 + 0.25e-3)  # half of bucket 1 + the all-gather
    # a traced rank's per-step figure comes from its kernels only; the timers still give per-bucket rows
    assert not rows_by(result, "overlap.exposed_dp_comm_per_step", rank=0, source="timers")


def test_comm_after_the_last_step_lands_in_no_step(tmp_path):
    # The forced param all-gather after the loop is step-less: a second-long wait there changes no per-step figure.
    run, _ = make_run(tmp_path / "run", Spec(final_sync_s=1.6, traces=False))
    result = reconcile(run)
    exposed = one(result, "overlap.exposed_dp_comm_per_step", rank=0, source="timers")
    assert exposed.measured == pytest.approx(0.5e-3 + 0.25e-3)
    gather = one(result, "overlap.all_gather.comm_time", rank=0, bucket=0, source="timers")
    assert gather.measured == pytest.approx(0.25e-3)


def test_comm_time_predicted_from_the_bandwidth_sweep(clean):
    result, _ = clean
    r = one(result, "overlap.reduce_scatter.comm_time", rank=1, bucket=0, source="timers")
    assert r.predicted == pytest.approx(1e-3) and r.verdict == "ok"


@pytest.mark.parametrize("speedup, timers, trace", [(4.0, "n/a", "off"), (0.25, "off", "warn")])
def test_a_timer_span_bounds_comm_time_from_above(tmp_path, speedup, timers, trace):
    # Timers span issue -> wait returned: longer than the sweep's time cannot tell a slow collective from a late wait
    # (the trace row judges it); shorter beyond the tolerance is off, the true time being shorter still. The trace's
    # kernel duration is the collective itself and is judged both ways.
    run, _ = make_run(tmp_path / "run", Spec(sweep_speedup=speedup))
    result = reconcile(run)
    timed = one(result, "overlap.reduce_scatter.comm_time", rank=1, bucket=0, source="timers")
    assert timed.predicted == pytest.approx(1e-3 / speedup) and timed.verdict == timers
    if timers == "n/a":
        assert "the trace row (source trace) judges it" in timed.explanation
    assert one(result, "overlap.reduce_scatter.comm_time", rank=1, bucket=0, source="trace").verdict == trace


def test_comm_volume_three_columns(clean):
    result, known = clean
    r = one(result, "comm.dp.reduce_scatter.bytes_per_step", rank=0)
    assert r.predicted == r.inventory == r.measured and r.verdict == "ok"
    p2p = one(result, "comm.pp.send_recv.bytes_per_step", rank=3)
    assert p2p.measured == p2p.predicted


def test_comm_counters_skip_the_first_step_which_owes_no_param_all_gather(tmp_path):
    # Under --overlap-param-gather step N's all-gather runs in step N+1: step 1 has none, the steady step one.
    run, _ = make_run(tmp_path / "run", Spec(first_step_all_gather=False, traces=False))
    r = one(reconcile(run), "comm.dp.all_gather.bytes_per_step", rank=0)
    assert r.inventory == r.predicted and r.verdict == "ok"


def gloo_trace_events(steps: int, rs_numel: int, ag_numel: int) -> list[dict]:
    """A CPU trace as ProcessGroupGloo annotates it: the reduce-scatter as gloo:all_reduce, the all-gather with its
    input only, one send and one recv of a [16, 1, 64] bf16 activation per step, each after the dispatcher's
    c10d::send / c10d::recv_ op (a TensorList: dims, no element type)."""
    def gloo(op, ts, dims, dtype="float"):
        return {"ph": "X", "cat": "user_annotation", "name": f"gloo:{op}", "pid": 100, "tid": 1, "ts": ts,
                "dur": 10.0, "args": {"Input Dims": [dims], "Input type": [dtype]}}

    def c10d(name, ts):
        return {"ph": "X", "cat": "cpu_op", "name": name, "pid": 100, "tid": 1, "ts": ts, "dur": 1.0,
                "args": {"Input Dims": [[[16, 1, 64]], [], [], []], "Input type": ["TensorList", "", "Scalar", ""]}}

    out = []
    for step in range(1, steps + 1):
        t0 = step * 1e6
        out += [{"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{step}", "pid": 100, "tid": 1,
                 "ts": t0, "dur": 1e5},
                gloo("all_reduce", t0 + 10, [rs_numel]), gloo("all_gather", t0 + 30, [ag_numel]),
                c10d("c10d::send", t0 + 45), gloo("send", t0 + 50, [16, 1, 64], "c10::BFloat16"),
                c10d("c10d::recv_", t0 + 65), gloo("recv", t0 + 70, [16, 1, 64], "c10::BFloat16")]
    return out


def test_gloo_trace_is_no_measurement_of_reduce_scatter_all_reduce_all_gather(tmp_path):
    spec = Spec(cuda=False, traces=False)
    run, _ = make_run(tmp_path / "run", spec)
    trace = write_trace(run, spec, 0, gloo_trace_events(spec.steps, 1000, 500))
    info = json.loads(gzip.decompress(trace.read_bytes()))["distributedInfo"]
    assert info["backend"] == "gloo"
    result = reconcile(run)
    for op in ("reduce_scatter", "all_gather"):  # no c10d op issued these annotations: gloo's own is no measurement
        r = one(result, f"comm.dp.{op}.bytes_per_step", rank=0)
        assert r.measured is None and "gloo backend" in r.explanation and r.source == "events"
        assert r.predicted == r.inventory and r.verdict == "ok"  # the formula still checks the engine's counter
    p2p = one(result, "comm.pp.send_recv.bytes_per_step", rank=0)
    # send + recv, counted once each from the dispatcher ops at the run's params dtype (bf16: 2 bytes an element)
    assert (p2p.measured, p2p.source) == (2 * 16 * 64 * 2, "trace")
    assert "params dtype bf16" in p2p.explanation


def test_the_manifest_names_the_backend_before_the_trace(tmp_path):
    spec = Spec(cuda=False, traces=False)
    run, _ = make_run(tmp_path / "run", spec)
    path = write_trace(run, spec, 0, gloo_trace_events(spec.steps, 1000, 500))
    trace = json.loads(gzip.decompress(path.read_bytes()))
    trace["distributedInfo"]["backend"] = "nccl"  # a trace that says otherwise does not override the manifest
    path.write_bytes(gzip.compress(json.dumps(trace).encode()))
    assert one(reconcile(run), "comm.dp.all_gather.bytes_per_step", rank=0).measured is None


def test_a_collective_is_the_op_its_name_states_first():
    # The engine names a backward collective after the forward one it conjugates: "sp all-gather (reduce-scatter
    # bwd)" runs an all-gather. Matching the later name swapped TP+SP's all-gather and reduce-scatter counters.
    assert normalize_op("sp all-gather (reduce-scatter bwd)") == "all_gather"
    assert normalize_op("sp reduce-scatter (gather bwd)") == "reduce_scatter"
    assert normalize_op("ncclDevKernel_ReduceScatter_Sum_f32_RING_LL") == "reduce_scatter"
    assert normalize_op("ncclDevKernel_AllReduce_Sum_f32_RING_LL") == "all_reduce"
    assert normalize_op("c10d::_reduce_scatter_base_") == "reduce_scatter"
    assert normalize_op("ncclDevKernel_SendRecv") == "send_recv" and normalize_op("forward stage0") is None


def test_memory_terms(clean):
    result, known = clean
    mem = known["memory"][2]
    static = one(result, "memory.static_after_first_step", rank=2)
    assert static.measured == mem["stepped"] and static.verdict == "ok"
    assert one(result, "memory.fragmentation", rank=2).measured == mem["reserved"] - mem["peak"]
    assert one(result, "memory.outside_pytorch", rank=2).measured == 500 * 2**20
    assert one(result, "memory.device_total", rank=2).measured == mem["nvml"]


def test_adam_moments_explain_the_gap_between_init_and_first_step(clean):
    result, known = clean
    cfg = known["config"]
    gap = one(result, "memory.adam_lazy_state", rank=1)
    owned = owned_param_elements(cfg, pp_rank=0, dp_rank=1)
    assert gap.predicted == 8 * owned == gap.measured
    assert "first step" in gap.explanation


@pytest.mark.parametrize("error, verdict", [(0.03, "ok"), (0.1, "warn"), (0.2, "off")])
def test_peak_against_its_5_percent_tolerance(tmp_path, error, verdict):
    run, _ = make_run(tmp_path / "run", Spec(peak_error=error))
    peak = rows_by(reconcile(run), "memory.peak_allocated")
    assert {r.verdict for r in peak} == {verdict}
    assert all(r.rel_diff == pytest.approx(error, abs=1e-6) for r in peak)


def test_cpu_run_says_not_measured(tmp_path):
    run, _ = make_run(tmp_path / "run", Spec(cuda=False, traces=False))
    result = reconcile(run)
    static = one(result, "memory.static_after_first_step", rank=0)
    assert static.measured is None and NOT_ON_CPU in static.explanation
    assert static.verdict == "off"  # the synthetic inventory lists only part of the static state
    assert not rows_by(result, "memory.fragmentation") and not rows_by(result, "memory.outside_pytorch")
    assert "no profiler traces (--use-pytorch-profiler)" in result.missing


@pytest.mark.parametrize("cuda, cores, shared", [(False, 2, True), (False, None, True), (False, 4, False),
                                                  (True, None, False)])
def test_timed_rows_are_not_judged_under_cpu_oversubscription(tmp_path, cuda, cores, shared):
    # 4 ranks on one host: on 2 cores (or an unrecorded count) each rank waits for a core; the timed rows are shown
    # unjudged and the run's notes say why, once (ledger.reconcile.oversubscribed).
    run, _ = make_run(tmp_path / "run", Spec(cuda=cuda, cpu_cores=cores, traces=False))
    result = reconcile(run)
    bubble = one(result, "pipeline.bubble_of_wall_time", rank=0)
    assert bubble.verdict == ("n/a" if shared else "ok") and bubble.measured is not None
    step = one(result, "throughput.step_time_vs_other_ranks", rank=0)
    assert step.verdict == ("n/a" if shared else "ok")
    notes = [m for m in result.missing if m.startswith("timings not judged")]
    assert len(notes) == (1 if shared else 0)
    assert ("4 ranks share host node0's 2 cores" in "".join(notes)) == (shared and cores == 2)
    assert one(result, "memory.static_after_first_step", rank=0).verdict != "n/a"


def test_straggler(tmp_path):
    run, known = make_run(tmp_path / "run", Spec(straggler={3: 0.01}))
    result = reconcile(run)
    assert one(result, "throughput.step_time_vs_other_ranks", rank=3).verdict == "off"
    assert one(result, "throughput.step_time_vs_other_ranks", rank=0).verdict == "ok"
    assert one(result, "throughput.step_time_spread").verdict == "off"


def test_crashed_run_reconciles_what_exists(tmp_path):
    run, _ = make_run(tmp_path / "run", Spec(status="running"))
    with open(run / "ranks/rank1/events.jsonl", "a") as f:
        f.write('{"kind": "step", "step": 4, "loss"')
    (run / "ranks/rank3/events.jsonl").unlink()
    result = reconcile(run)
    assert any("status is 'running'" in m for m in result.missing)
    assert any("rank(s) 3 of 4" in m for m in result.missing)
    assert any("torn line" in m and "1" in m for m in result.missing)
    assert rows_by(result, "memory.static_after_first_step", rank=0)


def test_cli_writes_files_and_json_is_the_only_stdout(clean, tmp_path, capsys):
    run, _ = make_run(tmp_path / "run")
    assert cli(["reconcile", str(run), "--json"]) == 0
    out = capsys.readouterr().out
    data = json.loads(out)
    assert set(data) == {"run", "verdicts", "missing", "rows"}
    assert (run / "ledger/reconciliation.json").is_file()
    header = (run / "ledger/reconciliation.csv").read_text().splitlines()[0]
    assert header.startswith("metric,scope,predicted,inventory,measured,unit,tolerance,explanation,rank,stage")


def test_fail_on(tmp_path, capsys):
    run, _ = make_run(tmp_path / "run", Spec(peak_error=0.1))
    assert cli(["reconcile", str(run), "--fail-on", "off"]) == 0
    assert capsys.readouterr().err == ""
    assert cli(["reconcile", str(run), "--fail-on", "warn"]) == 1
    (line,) = capsys.readouterr().err.strip().splitlines()  # which rows failed, in one line
    assert line.startswith("train-ledger reconcile: ") and "at or above 'warn'" in line
    assert "memory.peak_allocated" in line
    assert cli(["reconcile", str(run)]) == 0


def test_the_real_h200_run_reconciles_static_memory_to_the_byte(tmp_path):
    """The committed H200 run (llama3.2-1b shape cut to 2 layers, bf16, distributed optimizer at N_d = 1): after
    optimizer init the device holds bf16 params (2) + fp32 main grads (4) + fp32 master weights (4) = 10 bytes per
    parameter, and formula, engine inventory and memory_stats agree to the byte; Adam's m and v (8 more) come with
    the first step."""
    import shutil

    from ledger.reconcile.run import reconcile

    run = tmp_path / "run"
    shutil.copytree(Path(__file__).parent / "fixtures" / "gpu_h200_llama1b_l2", run)
    h, f, v, q_kv = 2048, 8192, 128256, (32 + 2 * 8) * 64
    per_layer = h * q_kv + h * h + 3 * h * f + 2 * h  # QKV, output projection, SwiGLU, two RMSNorms
    assert per_layer == 60_821_504
    params = 2 * per_layer + 2 * v * h + h  # embedding, output layer, final norm
    rows = {r.metric: r for r in reconcile(run).rows}
    static = rows["memory.static_after_optimizer_init"]
    assert static.predicted == static.inventory == static.measured == 10 * params
    after_step = rows["memory.static_after_first_step"]
    assert after_step.predicted == after_step.inventory == 18 * params and after_step.verdict == "ok"
    assert rows["memory.bytes_per_param"].predicted == 18 and rows["memory.bytes_per_param"].verdict == "ok"
    assert not [r.metric for r in rows.values() if r.verdict == "off"]


def test_the_engines_groups_are_checked_against_megatrons_rule():
    """The manifest records the groups each rank joined; the ledger derives its own and a wrong group is off, named.
    (A manifest built here: the rule itself is tested on the engine's real groups in test_reconcile_gloo.)"""
    from common.rank_info import parse_rank_infos
    from ledger.evidence.layout import Layout
    from ledger.evidence.run import RunEvidence
    from ledger.reconcile.topology import groups_rows

    rank3 = {"tp": [2, 3], "dp": [1, 3], "pp": [3, 7], "dp_cp": [1, 3], "cp": [3], "mp": [2, 3, 6, 7],
             "embedding": [3, 7], "position": [3]}  # rank = tp + 2 dp + 4 pp
    manifest = {"world_size": 8,
                "ranks": [{"rank": 1, "groups": {**rank3, "tp": [0, 1], "pp": [1, 5], "cp": [1], "mp": [0, 1, 4, 5],
                                                 "embedding": [1, 5], "position": [1]}},
                          {"rank": 3, "groups": {**rank3, "dp": [2, 3]}}]}
    ev = RunEvidence(run_dir=Path("."), manifest=manifest, config=None, ranks={}, traces=[],
                     layout=Layout.of(8, tp=2, pp=2), rank_infos=parse_rank_infos(manifest["ranks"]))
    ok, wrong = groups_rows(ev)
    assert (ok.rank, ok.measured, ok.verdict) == (1, 0, "ok")
    assert (wrong.rank, wrong.measured, wrong.verdict) == (3, 1, "off")
    assert wrong.explanation.endswith("dp [2, 3] (Megatron's rule: [1, 3])")


def test_embedding_all_reduce_rows_from_counters_and_trace():
    """Tied embeddings under PP2: each end all-reduces its copy's grad once per step over the embedding group, whose
    ranks are also the pipeline group's. The engine's embd-comm range and the trace's all-reduce on those ranks land
    in comm.embedding.all_reduce; the send / recv on the same ranks stays the pipeline's; a wrong figure is off."""
    from common.arguments import parse_args
    from common.events import event
    from ledger.evidence.layout import Layout
    from ledger.evidence.run import RankEvidence, RunEvidence
    from ledger.evidence.traces import Collective, TraceSummary
    from ledger.reconcile.comm import trace_volume, volume_rows

    cfg = parse_args("--model tiny --world-size 2 --pipeline-model-parallel-size 2 --global-batch-size 2".split())
    size = 1000 * 64 * 4  # the vocabulary matrix's fp32 grad
    ev = RunEvidence(run_dir=Path("."), manifest={"world_size": 2}, config=cfg, ranks={}, traces=[])
    groups = ev.groups(1)
    assert groups == {"tp": (1,), "dp": (1,), "pp": (0, 1), "embedding": (0, 1), "mp": (0, 1)}
    timing = [event("timing", s, category="embd-comm", name="all-reduce word embedding grads", bytes=size,
                    start_s=0.0, end_s=1.0) for s in (1, 2, 3)]
    r = RankEvidence(rank=1, coords={"tp": 0, "cp": 0, "dp": 0, "pp": 1}, timing=timing)
    trace = TraceSummary(path=Path("rank1.json"), rank=1, world_size=2, backend="nccl",
                         steps={2: (0.0, 10.0), 3: (10.0, 20.0)},
                         collectives=[c for t in (0.0, 10.0) for c in (
                             Collective("send", t + 1, t + 2, 4096, (0, 1)),
                             Collective("all_reduce", t + 5, t + 6, size, (0, 1)))])
    measured = trace_volume(trace, groups, None)
    assert measured == {("pp", "send_recv"): 4096, ("embedding", "all_reduce"): size}
    rows = {x.metric: x for x in volume_rows(cfg, r, measured)}
    ok = rows["comm.embedding.all_reduce.bytes_per_step"]
    assert (ok.predicted, ok.inventory, ok.measured, ok.verdict) == (size, size, size, "ok")
    (wrong,) = [x for x in volume_rows(cfg, r, {("embedding", "all_reduce"): size / 2})
                if x.metric == "comm.embedding.all_reduce.bytes_per_step"]
    assert wrong.verdict == "off"
    # A middle stage is in no embedding group; PP4's ends pair ranks 0 and 3.
    pp4 = RunEvidence(run_dir=Path("."), manifest={"world_size": 4}, config=None, ranks={}, traces=[],
                      layout=Layout.of(4, pp=4))
    assert "embedding" not in pp4.groups(1) and pp4.groups(3)["embedding"] == (0, 3)
