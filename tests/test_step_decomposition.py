"""Where each profiled step went (docs/formulas.md, "Step decomposition"): the partition of a step window into named
terms, its rows in the reconciliation and its section in report.md. The claims about real steps (they add up, which
term dominates which run) are made on the committed traces; the priority order on a hand-written trace (plumbing)."""
from __future__ import annotations

import shutil
from functools import lru_cache
from pathlib import Path

import pytest

from common.intervals import covered, union
from ledger.evidence.exec_graph import ExecGraph, read_graph
from ledger.evidence.rank_sets import RankChoice
from ledger.evidence.step_partition import (
    COMPUTE,
    DATA_WAIT,
    HOST_BOUND,
    LAUNCH,
    PIPELINE_WAIT,
    SLOWER_RANK,
    SYNC,
    CommSpan,
    nccl_spans,
    partition_step,
    with_arrivals,
)
from ledger.evidence.traces import Collective
from ledger.models.time_model.host_costs import KERNEL_GAP, LAUNCH_LATENCY
from ledger.present import report, units
from ledger.reconcile.run import TraceWork, reconcile, write
from ledger.reconcile.step_decomposition import REPLAY_METRIC, TERM_METRIC, group_of, term_of
from tests.support.kineto import gpu, host, launch, runtime, step, write_trace
from tests.support.recorded_runs import reconcile_recorded

FIXTURES = Path(__file__).parent / "fixtures"
# Every committed trace (the two-rank PP2 slice aside: its own test below); these three first, for the tests that take
# a hand-checked few.
FIRST = ["h200_2layer_profiled/traces/rank0.step4-5.json.gz", "gpu_h200_llama1b_l2/traces/rank0.step3-4.json.gz",
         "megatron_lm_1gpu/torch_profile/rank-0.json.gz"]
GRAPHED = "h200_cuda_graphs/lb_h1024_l4_s512_graphed/traces/rank0.step5-6.json.gz"
GPU_BOUND = "h200_llama1b/s4096_profiled/traces/rank0.step7-7.json.gz"
TRACES = FIRST + sorted(str(p.relative_to(FIXTURES)) for p in FIXTURES.rglob("*.json.gz")
                        if p.parent.name in ("traces", "torch_profile") and str(p.relative_to(FIXTURES)) not in FIRST)


@lru_cache(maxsize=None)
def graph(trace: str) -> ExecGraph:
    return read_graph(FIXTURES / trace)


def terms(trace: str, n: int) -> dict[str, float]:
    return dict(partition_step(graph(trace), n, []).terms)


@pytest.mark.parametrize("trace", TRACES)
def test_the_terms_of_every_profiled_step_add_up_to_its_window(trace: str):
    g = graph(trace)
    for n, window in g.steps.items():
        part = partition_step(g, n, [])
        assert part.measured == window.end - window.start
        assert abs(part.total - part.measured) <= 1.0  # µs
        assert all(t >= 0 for _, t in part.terms)


@pytest.mark.parametrize("trace", TRACES[:3])
def test_device_compute_is_the_time_the_gpu_ran_anything_but_nccl(trace: str):
    g = graph(trace)
    busy = union((op.start, op.end) for op in g.gpu_ops() if op.collective is None)
    for n, window in g.steps.items():
        assert terms(trace, n)[COMPUTE] == pytest.approx(covered((window.start, window.end), busy), abs=1e-6)


def test_the_host_bound_h200_run_idles_its_gpu_about_half_of_each_step():
    # The 2-layer seq-1024 run the time model under-predicts (its README): the GPU computes 29.2 ms of 53-61 ms
    # steps; the step-end stream syncs leave the GPU idle only while the host wakes (~0.1 ms); its 558 kernels a
    # step, about half of them enqueued before their predecessor ended, leave ~0.9 ms of launch latency.
    for n in (4, 5, 6):
        t = terms(TRACES[0], n)
        assert 29.1e3 < t[COMPUTE] < 29.3e3
        assert 0.05e3 < t[SYNC] < 0.3e3
        assert 0.8e3 < t[LAUNCH] < 1.0e3
        assert t[HOST_BOUND] > 0.4 * sum(t.values())


def test_the_gpu_bound_h200_step_idles_between_enqueued_kernels_more_than_for_its_host():
    # llama3.2-1b at seq 4096, step 7: 6,213 kernels, all but 141 enqueued before their predecessor ended, 1.76 µs
    # apart on average: 10.9 ms of the 26 ms the GPU did not compute is the device getting to work it already held,
    # which neither a faster host nor CUDA graphs of the host's calls would give back whole.
    t = terms(GPU_BOUND, 7)
    assert 527e3 < t[COMPUTE] < 529e3
    assert 10.5e3 < t[LAUNCH] < 11.5e3
    assert 14e3 < t[HOST_BOUND] < 16e3


def test_a_profiler_windows_first_step_begins_with_the_profilers_own_start():
    # Every committed H200 trace whose window opens on its first ProfilerStep: 2.2-3.0 ms pass on the host before the
    # step's first event record (the timers' step begin), against 0.03-0.5 ms in the window's later steps. That time
    # is host-bound idle of the first step only (the twin adds PROFILER_START there).
    for trace in (TRACES[0], TRACES[1], GRAPHED, GPU_BOUND):
        g = graph(trace)
        starts = []
        for n, window in sorted(g.steps.items()):
            first = min(op.start for t in g.threads for op in t.ops
                        if op.name.startswith("cudaEventRecord") and window.start <= op.start < window.end)
            starts.append(first - window.start)
        assert 2.2e3 < starts[0] < 3.0e3 and all(s < 0.5e3 for s in starts[1:])


def test_the_launch_figures_are_the_calibration_runs():
    # KERNEL_GAP and LAUNCH_LATENCY (ledger/models/time_model/host_costs.py) are the calibration run's means, in each
    # of its profiled steps, over its kernels after the first: one enqueued before its predecessor ended waits the
    # gap after it; one launched after the device had gone idle starts the latency after its launch call returned.
    g = graph(TRACES[0])
    for window in g.steps.values():
        ops = sorted((op for op in g.gpu_ops() if op.collective is None and window.start <= op.start < window.end),
                     key=lambda op: op.start)
        gaps, latencies, end = [], [], ops[0].end
        for op in ops[1:]:
            if op.launch is not None and op.launch.end <= end:
                gaps.append(max(0.0, op.start - end))
            elif op.launch is not None:
                latencies.append(op.start - op.launch.end)
            end = max(end, op.end)
        assert (290 < len(gaps) < 300) and (255 < len(latencies) < 265)
        assert sum(gaps) / len(gaps) * 1e-6 == pytest.approx(KERNEL_GAP, rel=0.03)
        assert sum(latencies) / len(latencies) * 1e-6 == pytest.approx(LAUNCH_LATENCY, rel=0.12)


def test_the_megatron_step_is_host_bound_with_syncs_and_data_waits_beside():
    # 4 ms of GPU work in a 99 ms step: what the time model's 1.6 ms against 89.8 ms missed is the host.
    for n in (5, 6, 7):
        t = terms(TRACES[2], n)
        assert 4.0e3 < t[COMPUTE] < 4.1e3 and t[HOST_BOUND] > 0.9 * sum(t.values())
        assert 0.3e3 < t[DATA_WAIT] < 0.5e3  # torch's DataLoader iterations
        assert 0.7e3 < t[SYNC] < 0.9e3  # 97 aten::item a step, each waiting for its copy


def test_the_pp2_first_stage_waits_for_the_second_in_its_sendrecv_kernels():
    # The PP2 slice's SendRecv pairs, matched across the two ranks: on the first stage each step holds ~120 ms of
    # kernels started before the second stage arrived (the backward it waits for), against ~0.7 ms of transfer;
    # the second stage waits ~10 ms.
    graphs = [read_graph(FIXTURES / f"h200_pp2_p2p_slice/rank{r}.json.gz") for r in (0, 1)]
    items = [item for g in graphs for item in nccl_spans(g, lambda c: "pp")]
    spans = with_arrivals(items)
    for g in graphs:
        mine = [span for (rank, _, _), span in zip(items, spans) if rank == g.rank]
        for n in (9, 10, 11):
            t = dict(partition_step(g, n, mine).terms)
            wait, transfer = t[PIPELINE_WAIT], t["exposed communication pp"]
            assert (100e3 < wait < 130e3) if g.rank == 0 else (5e3 < wait < 15e3)
            assert 0.4e3 < transfer < 1e3


def test_each_instant_goes_to_the_first_term_whose_condition_holds(tmp_path: Path):
    # Hand-written (plumbing): a kernel 0-100, an all-reduce kernel 50-200 whose last peer arrived at 120, then the
    # GPU idle 200-290 while the host syncs (200-250), waits for data (260-280) and launches a kernel (its call
    # 280-285) that starts at 290 and runs to the window's end.
    events = [step(1, 0, 300), *launch(1, -20, 0, 100, stream=7), runtime("cudaStreamSynchronize", 200, 50),
              host("wait data mb0", 260, 20, cat="user_annotation"), *launch(2, 280, 290, 10, stream=7),
              gpu("ncclDevKernel_AllReduce", 50, 150, stream=30, corr=None)]
    g = read_graph(write_trace(tmp_path / "t.json", events))
    part = partition_step(g, 1, [CommSpan(50, 200, "dp", p2p=False, ready=120)])
    assert dict(part.terms) == {COMPUTE: 110, "exposed communication dp": 80, "pipeline wait": 0, SLOWER_RANK: 20,
                                LAUNCH: 5, DATA_WAIT: 20, SYNC: 50, HOST_BOUND: 15}


def test_a_collective_on_the_cp_or_ep_group_is_named_after_it():
    # Plumbing: kernel_group knows tp, dp, pp and embedding; a CP2 x DP2 rank's cp group is another rank set.
    groups, extra = {"tp": (0,), "dp": (0, 2), "pp": (0,)}, {"cp": (0, 1), "ep": (0, 3)}
    assert group_of(Collective("all_gather", 0, 1, None, (0, 1)), groups, extra) == "cp"
    assert group_of(Collective("all_to_all", 0, 1, None, (3, 0)), groups, extra) == "ep"
    assert group_of(Collective("all_reduce", 0, 1, None, (0, 2)), groups, extra) == "dp"
    assert group_of(Collective("all_reduce", 0, 1, None, (0, 5)), groups, extra) == "other"


# --- rows and report, on the committed run directories ---------------------------------------------------------
@lru_cache(maxsize=None)
def step_rows(fixture: str) -> tuple:
    return tuple(r for r in reconcile_recorded(FIXTURES / fixture).rows if r.metric.startswith("step."))


@pytest.mark.parametrize("fixture", ["h200_2layer_profiled", "megatron_lm_1gpu", "gloo_dp2_overlap", "gloo_pp2"])
def test_each_profiled_step_has_its_terms_and_a_judged_replay_row(fixture: str):
    rows = step_rows(fixture)
    replays = {r.step: r for r in rows if r.metric == REPLAY_METRIC}
    assert replays and all(r.verdict == "ok" and r.tolerance == 0.03 for r in replays.values())
    for n, rep in replays.items():
        parts = [r for r in rows if r.metric.startswith(TERM_METRIC) and r.step == n]
        assert abs(sum(r.measured for r in parts) - rep.measured) <= 1e-6  # s: 1 µs
        assert "critical path: host on thread" in rep.explanation


@pytest.mark.parametrize("fixture, why", [("megatron_lm_1gpu", "no compute sweep records"),
                                          ("gloo_pp2", "no compute sweep records"),
                                          ("gloo_dp2_sweeps", "a CPU rank runs its ops on the calling thread")])
def test_a_term_without_a_host_timeline_stays_unpredicted_and_says_why(fixture: str, why: str):
    # The twins come from the time model's host timeline (tests/test_host_model.py judges them): a run without a
    # compute sweep has no time model, a CPU rank no host timeline.
    parts = [r for r in step_rows(fixture) if r.metric.startswith(TERM_METRIC)]
    assert parts and all(r.predicted is None and r.verdict == "n/a" and why in r.explanation for r in parts)


@pytest.mark.parametrize("fixture, group", [("gloo_dp2_overlap", "dp"), ("gloo_pp2", "pp")])
def test_a_gloo_runs_steps_hold_compute_and_communication_named_after_its_group(fixture: str, group: str):
    # gloo's point-to-point ranges run on the main thread, its collectives on worker threads: either way they are
    # communication, not compute. One rank traced: the pp figure also holds the wait for the other stage.
    rows = [r for r in step_rows(fixture) if r.metric.startswith(TERM_METRIC)]
    for n in {r.step for r in rows}:
        t = {term_of(r.metric): r.measured for r in rows if r.step == n}
        assert t[COMPUTE] > 5e-3 and t[f"exposed communication {group}"] > 3e-3  # s


@pytest.mark.parametrize("choice, replayed, missing", [
    ("ends", [0, 1], None),
    ("1", [1], "step decomposition and replay run on rank(s) 1 only of the 2 traced ranks, not on 0 "
               "(--replay-ranks all replays every rank)"),
    ("none", [], "step decomposition and replay run on no rank of the 2 traced ranks, not on 0-1 "
                 "(--replay-ranks all replays every rank)")])
def test_the_replay_runs_on_the_chosen_ranks_and_says_which_it_left_out(choice: str, replayed: list[int],
                                                                       missing: str | None):
    # Replaying a rank's graph costs seconds per rank on a full trace: on a cluster only the chosen ranks get rows.
    result = reconcile(FIXTURES / "gloo_pp2_sweeps", TraceWork(replay=RankChoice.parse(choice, "--replay-ranks")))
    assert sorted({r.rank for r in result.rows if r.metric.startswith("step.")}) == replayed
    left_out = [m for m in result.missing if m.startswith("step decomposition")]
    assert left_out == ([missing] if missing else [])


def test_ends_are_the_first_and_the_last_traced_rank():
    traced = [0, 1, 2, 5, 7]
    assert RankChoice().pick(traced) == [0, 7] and RankChoice().pick([3]) == [3] and RankChoice().pick([]) == []
    assert RankChoice.parse("all", "--x").pick(traced) == traced
    assert RankChoice.parse("2-6,9", "--x").pick(traced) == [2, 5]


def test_report_md_shows_where_each_step_went(tmp_path: Path):
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "h200_2layer_profiled", run)
    write(reconcile(run))
    md, _ = report.write(str(run))
    text = md.read_text()
    section = text.split("## Where the step went", 1)[1].split("\n## ", 1)[0].split("\n### ", 1)[0]
    table = [line for line in section.splitlines() if line.startswith("| 0 |")]
    assert [line.split(" | ")[1] for line in table] == ["4", "5", "6"]
    assert "| device compute |" in section and "| sum = measured step | model's sum | replayed |" in section
    assert table[0].split(" | ")[-3] == "61.1 ms"  # the sum of the terms: step 4's window
    # each term beside the time model's twin of it (the host timeline's, from the config and the run's sweeps), and
    # the twin's sum beside the measured one
    rows = [r for r in reconcile(run).rows if r.metric.startswith("step.decomposition.") and r.step == 4]
    twin = {r.metric: r.predicted for r in rows}
    device = twin["step.decomposition.device_compute"]
    assert f"; model {units.duration(device)}" in table[0].split(" | ")[2]
    assert table[0].split(" | ")[-2] == units.duration(sum(twin.values()))
    assert "rank 0, step 4: host on thread" in section
