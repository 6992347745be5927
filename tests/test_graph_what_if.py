"""What if on a measured run's execution graph (ledger.models.graph_what_if, `train-ledger whatif`).

Claims on committed runs (docs/formulas.md, "What if on the graph"): the host-bound H200 trace (h200_2layer_profiled)
gains little from faster kernels and most of its step back without launch gaps, down to its device compute; the
GPU-bound one (h200_llama1b/s4096_profiled), its launch gaps gone, loses half its GEMM time with GEMMs twice as fast,
and as it ran gains only a few percent (its host close behind); the
gloo PP2 run (gloo_pp2_sweeps, both ranks traced) replays each rank alone, every change shortening no step's replay
beyond what it changed. The straggler and the cross-rank propagation are plumbing on a hand-written pair of GPU traces
(no committed run has GPU traces of two ranks), said so there. Bad input is one line and exit status 2.
"""
from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path

import pytest

import cli.main as cli
from common.errors import ConfigError, InputError
from common.intervals import covered
from common.rank_info import RankInfo
from common.run_dir import TraceFile
from ledger.evidence.exec_graph import read_graph
from ledger.evidence.read import read_run
from ledger.evidence.run import RunEvidence
from ledger.evidence.step_partition import device_compute
from ledger.models.graph_what_if import Change, WhatIfAnswer, what_if
from ledger.reconcile.step_decomposition import CLASS_METRIC
from tests.support.kineto import host, launch, runtime, step, write_trace
from tests.support.recorded_runs import FIXTURES, only, reconcile_recorded

H200, GLOO, GPU_BOUND = "h200_2layer_profiled", "gloo_pp2_sweeps", "h200_llama1b/s4096_profiled"
# Steps 4-6 of the H200 trace, ms: (measured, replayed, kernels 2x faster, no launch gaps), as this replay gives them.
H200_STATED = {4: (61.098, 61.105, 58.221, 30.356), 5: (52.864, 52.872, 50.004, 30.341),
               6: (54.219, 54.229, 51.417, 30.368)}


@lru_cache(maxsize=None)
def answer(fixture: str, **change) -> WhatIfAnswer:
    return what_if(read_run(FIXTURES / fixture), Change(**change))


def test_faster_kernels_gain_a_host_bound_step_little_and_no_launch_gaps_most():
    faster, no_gaps = answer(H200, kernels=2.0), answer(H200, no_launch_gaps=True)
    assert [(s.rank, s.step) for s in faster.steps] == [(0, 4), (0, 5), (0, 6)]
    for s, g in zip(faster.steps, no_gaps.steps):
        measured, replayed, kernels, gaps = H200_STATED[s.step]
        assert (s.measured * 1e3, s.replayed * 1e3) == pytest.approx((measured, replayed), abs=0.01)
        assert (g.measured, g.replayed) == (s.measured, s.replayed)  # one baseline, whatever the change
        assert s.what_if * 1e3 == pytest.approx(kernels, abs=0.01)
        assert g.what_if * 1e3 == pytest.approx(gaps, abs=0.01)
        assert -0.06 < s.gain < 0 and g.gain < -0.4


def test_without_launch_gaps_a_host_bound_step_comes_down_to_its_device_compute():
    """The device no longer waits for the host: the step is the device's own busy time (the partition's device
    compute term) plus the queue gaps and the sync's wake-up, a few percent."""
    graph = read_graph(next((FIXTURES / H200 / "traces").glob("rank0.*")))
    busy = device_compute(graph)
    for s in answer(H200, no_launch_gaps=True).steps:
        compute = covered((graph.steps[s.step].start, graph.steps[s.step].end), busy) / 1e6
        assert compute < s.what_if < 1.05 * compute


def test_the_answer_names_what_it_changed_and_that_one_rank_was_replayed_alone():
    a = answer(H200, kernels=2.0)
    (kernels,) = a.changed
    assert kernels.startswith("kernels 2x faster: the 1,512 GPU kernels that are not NCCL's")
    assert a.notes[0] == ("rank 0 replayed alone (a collective keeps its measured wait for its peers, scaled with it "
                          "when communication is faster)")
    assert a.notes[1].startswith("the replayed steps are profiled ones: this run's profiled steps took 53.3 ms against "
                                 "36.2 ms unprofiled")
    assert not a.together and a.ranks == [0]


@pytest.mark.parametrize("change", [dict(kernels=2.0), dict(comm=2.0)])
def test_a_cpu_runs_ranks_are_replayed_each_alone_and_no_step_grows(change):
    """A gloo run: compute ops or gloo / c10d ranges take half their host time; every step of both traced ranks
    comes out no longer than its replay, and the replay reproduces the window exactly (a CPU trace's replay is its
    measured host time)."""
    a = answer(GLOO, **change)
    assert not a.together and a.ranks == [0, 1]
    assert {(s.rank, s.step) for s in a.steps} == {(r, n) for r in (0, 1) for n in (4, 5, 6)}
    assert all(s.replayed == pytest.approx(s.measured, abs=1e-9) for s in a.steps)
    assert all(s.what_if <= s.replayed for s in a.steps) and any(s.gain < -0.05 for s in a.steps)
    assert "CPU run" in a.notes[0] and "host time" in a.changed[0]


def test_with_the_host_out_of_the_way_a_class_twice_as_fast_takes_half_its_time_off_the_step():
    """The GPU-bound H200 step (s4096_profiled, steps 7-8) without launch gaps (the device alone the bound): GEMMs 2x
    faster take half the step's GEMM time off it (the matmul class of its device compute, 324-338 ms), attention 2x
    faster half its attention (95-102 ms), both together the sum, each within 1%."""
    classes = {(r.step, r.metric.rsplit(".", 1)[1]): r.measured for r in reconcile_recorded(FIXTURES / GPU_BOUND).rows
               if r.metric.startswith(CLASS_METRIC)}
    base = answer(GPU_BOUND, no_launch_gaps=True)
    gemms, attention = answer(GPU_BOUND, no_launch_gaps=True, matmul=2.0), answer(GPU_BOUND, no_launch_gaps=True,
                                                                                   attention=2.0)
    both = answer(GPU_BOUND, no_launch_gaps=True, matmul=2.0, attention=2.0)
    for n, b, g, a, ga in zip((7, 8), base.steps, gemms.steps, attention.steps, both.steps):
        half_gemms, half_attention = classes[(n, "matmul")] / 2, classes[(n, "attention")] / 2
        assert b.what_if - g.what_if == pytest.approx(half_gemms, rel=0.01)
        assert b.what_if - a.what_if == pytest.approx(half_attention, rel=0.01)
        assert b.what_if - ga.what_if == pytest.approx(half_gemms + half_attention, rel=0.01)
    gemms_said = next(line for line in gemms.changed if line.startswith("GEMMs 2x faster"))
    assert " matmul kernels (each by the op that launched it" in gemms_said


def test_as_it_ran_the_gpu_bound_step_has_its_host_close_behind():
    """The same step with its launch gaps as measured: the host issues it in nearly the device's time (the 16-layer
    forward and backward of this engine take the host ~450 ms at seq 4096), so GEMMs 2x faster gain step 7 only
    about 4% (555 -> 532 ms) and all kernels 2x faster about 6%: the what-if says where the next bound is."""
    gemms, kernels = answer(GPU_BOUND, matmul=2.0).steps[0], answer(GPU_BOUND, kernels=2.0).steps[0]
    assert gemms.step == 7 and -0.05 < gemms.gain < -0.03 and -0.07 < kernels.gain < gemms.gain
    assert answer(GPU_BOUND, matmul=2.0, kernels=2.0).steps[0].what_if <= kernels.what_if  # they compound


def test_an_answer_on_profiled_steps_says_how_much_slower_the_profiler_made_them():
    # The profiler's cost is the throughput.profiler_overhead row's (one helper, ledger.evidence.steps): the what-if's
    # host is the profiled one, so the answer says so where that cost is more than 2%.
    (note,) = [n for n in answer(GPU_BOUND, matmul=2.0).notes if n.startswith("the replayed steps are profiled")]
    overhead = only(reconcile_recorded(FIXTURES / GPU_BOUND), "throughput.profiler_overhead")
    assert "took 590.2 ms against 551.5 ms unprofiled" in note
    assert "median profiled step 590.2 ms against median steady step 551.5 ms" in overhead.explanation
    assert not [n for n in answer(GLOO, kernels=2.0).notes if n.startswith("the replayed steps are profiled")]


def test_gemms_twice_as_fast_gain_the_host_bound_step_nothing():
    """The host-bound H200 step (h200_2layer_profiled): no GEMM is on its critical path, so GEMMs 2x faster leave
    every step as replayed, where all kernels 2x faster gain it 5% (the kernels a sync waits for)."""
    for g, k in zip(answer(H200, matmul=2.0).steps, answer(H200, kernels=2.0).steps):
        assert g.what_if == pytest.approx(g.replayed, abs=1e-6) and k.gain < -0.04


def test_a_cpu_runs_gemm_ops_take_the_speed_up():
    """A gloo run: the host time of compute ops inside aten::mm / addmm ... halves; no step grows, each shrinks by at
    most half its matmul class."""
    classes = {(r.rank, r.step): r.measured for r in reconcile_recorded(FIXTURES / GLOO).rows
               if r.metric == CLASS_METRIC + "matmul"}
    a = answer(GLOO, matmul=2.0)
    assert all(0 < s.replayed - s.what_if <= classes[(s.rank, s.step)] / 2 + 1e-6 for s in a.steps)
    assert a.changed[0].startswith("GEMMs 2x faster: a CPU run, so the host time in compute ops inside matmul ops")


# --- plumbing: two ranks replayed together (hand-written GPU traces) --------------------------------------------
def _rank_trace(tmp_path: Path, rank: int, gemm_us: float) -> Path:
    """One step: a GEMM of `gemm_us` on stream 7, then an all-reduce of both ranks on the same stream, then a stream
    sync; the all-reduce's transfer is 50 µs after the later rank (1, whose GEMM is longer) starts it."""
    tid = rank + 1
    gemm = launch(1, 10, 15, gemm_us, stream=7, tid=tid)
    start = 15 + gemm_us + 1
    nccl = launch(2, 20, start, 15 + 300 + 1 + 50 - start, stream=7, tid=tid, name="ncclDevKernel_AllReduce_Sum_f32",
                  **{"Collective name": "allreduce", "Process Group Ranks": "[0, 1]", "Seq": 1})
    events = [step(1, 0, 380, tid=tid), host("forward", 5, 3, tid=tid), *gemm, *nccl,
              runtime("cudaStreamSynchronize", 25, 346, tid=tid)]
    return write_trace(tmp_path / f"rank{rank}.json", events, rank=rank, world_size=2)


def _two_rank_run(tmp_path: Path, hosts: tuple[str, str] = ("node0", "node0")) -> RunEvidence:
    manifest = {"world_size": 2, "status": "complete", "ranks": [{"rank": r, "host": h} for r, h in enumerate(hosts)]}
    traces = [TraceFile(r, 1, 1, _rank_trace(tmp_path, r, gemm)) for r, gemm in ((0, 100.0), (1, 300.0))]
    return RunEvidence(run_dir=tmp_path, manifest=manifest, config=None, ranks={}, traces=traces,
                       rank_infos={r: RankInfo(r, host=h) for r, h in enumerate(hosts)})


def test_plumbing_the_straggler_brought_to_the_median_shortens_every_ranks_step(tmp_path: Path):
    """Rank 1 computes 300 µs, rank 0 100 µs: the median of two is 200 µs, so rank 1's GEMM takes 2/3 of its time,
    its all-reduce starts 100 µs earlier and, the collective matched across the ranks, both steps end 100 µs
    earlier: rank 0 waited that much less for its peer."""
    a = what_if(_two_rank_run(tmp_path), Change(no_straggler=True))
    assert a.together
    assert [(s.rank, round(s.replayed * 1e6), round((s.replayed - s.what_if) * 1e6)) for s in a.steps] == \
        [(0, 380, 100), (1, 380, 100)]
    (said,) = a.changed
    assert said.startswith("no straggler, step 1: rank 1 computed 0.30 ms against the median rank's 0.20 ms: its 1 "
                           "GPU ops launched in the step (not NCCL's) take 0.667")


def test_plumbing_faster_communication_shortens_the_transfer_not_the_wait(tmp_path: Path):
    """2x faster communication halves the 50 µs transfer after the last member arrived: 25 µs off both steps; rank
    0's 200 µs wait for rank 1 is no communication and stays."""
    a = what_if(_two_rank_run(tmp_path), Change(comm=2.0))
    assert [round((s.replayed - s.what_if) * 1e6) for s in a.steps] == [25, 25]


def test_plumbing_ranks_of_two_hosts_are_replayed_alone_and_refuse_the_straggler(tmp_path: Path):
    ev = _two_rank_run(tmp_path, hosts=("node0", "node1"))
    assert not what_if(ev, Change(kernels=2.0)).together
    with pytest.raises(InputError, match="more than one host"):
        what_if(ev, Change(no_straggler=True))


@pytest.mark.parametrize("change", [Change(), Change(kernels=0.0), Change(comm=-2.0), Change(kernels=float("nan")),
                                    Change(matmul=0.0), Change(attention=float("inf"))])
def test_a_change_that_changes_nothing_or_is_no_speed_up_is_refused(change: Change):
    with pytest.raises(ConfigError):
        what_if(read_run(FIXTURES / H200), change)


# --- the command --------------------------------------------------------------------------------------------------
def test_whatif_prints_the_table_and_json_prints_one_object(capsys):
    assert cli.main(["whatif", str(FIXTURES / H200), "--kernels-faster", "2", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["change"] == {"kernels_faster": 2.0, "comm_faster": 1.0, "no_launch_gaps": False,
                             "no_straggler": False, "matmul_faster": 1.0, "attention_faster": 1.0}
    assert [(s["rank"], s["step"]) for s in doc["steps"]] == [(0, 4), (0, 5), (0, 6)]
    assert doc["steps"][0]["what_if_s"] * 1e3 == pytest.approx(H200_STATED[4][2], abs=0.01)
    assert [j["step"] for j in doc["job"]] == [4, 5, 6]
    assert cli.main(["whatif", str(FIXTURES / H200), "--no-launch-gaps"]) == 0
    out = capsys.readouterr().out
    assert "| rank | step | measured | replayed | what if | change |" in out and "| 0 | 4 | 61.1 ms | 61.1 ms |" in out
    assert "no launch gaps (as CUDA graphs would have it)" in out


@pytest.mark.parametrize("args, message", [
    ([H200, "--kernels-faster", "0"], "argument --kernels-faster: 0: a speed-up is a positive finite number"),
    ([H200, "--comm-faster", "fast"], "argument --comm-faster: 'fast' is not a number"),
    ([H200, "--comm-faster", "inf"], "argument --comm-faster: inf: a speed-up is a positive finite number"),
    ([H200, "--matmul-faster", "-1"], "argument --matmul-faster: -1: a speed-up is a positive finite number"),
    ([H200, "--attention-faster", "x"], "argument --attention-faster: 'x' is not a number"),
    ([H200], "nothing to change"),
    (["h200_llama1b/s4096", "--kernels-faster", "2"], "s4096: no profiler traces (--use-pytorch-profiler)"),
    ([GLOO, "--no-launch-gaps"], "no launch gaps: the traces of rank(s) 0, 1 hold no GPU work (a CPU run)"),
    ([GLOO, "--no-straggler"], "no straggler: the replay does not match a CPU run's gloo collectives"),
    ([H200, "--no-straggler"], "no straggler: it compares the traced ranks, and this run traced rank 0 only"),
])
def test_bad_input_is_one_line_and_exit_status_2(args: list[str], message: str, capsys):
    assert cli.main(["whatif", str(FIXTURES / args[0]), *args[1:]]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and len(captured.err.strip().splitlines()) == 1 and message in captured.err
