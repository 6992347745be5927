"""Every judged row type can be off: each case builds the evidence of a clean run, checks the row is judged ok, then
feeds the same builder a wrong measurement and sees "off". Rows whose prediction is the time model's get the clean
measurement as their prediction (the model is wired separately), so only the measurement moves.

The clean run is synthetic (tests/fixtures/synthetic_run.py): these tests are about verdicts, not about a machine.
Also here: the verdict rules themselves (absolute floors, upper bounds, identity rows).
"""
from __future__ import annotations

import copy
import gzip
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest

from common.events import ALLOCATED, PEAK, RESERVED, TimingRecord
from ledger.evidence.layout import group_lists
from ledger.evidence.rank_sets import RankChoice
from ledger.evidence.read import read_run
from ledger.evidence.run import RunEvidence
from ledger.evidence.steps import run_steps
from ledger.evidence.traces import TraceSummary, summarize
from ledger.models.formulas.activations import local_seq_length
from ledger.reconcile.comm import p2p_element_bytes, trace_volume, volume_rows
from ledger.reconcile.data_wait import data_wait_rows
from ledger.reconcile.hta import CrossCheck, available, hta_rows
from ledger.reconcile.memory import memory_rows
from ledger.reconcile.overlap import NOT_COMPARED, overlap_rows, trace_overlap_rows
from ledger.reconcile.pipeline import pipeline_rows
from ledger.reconcile.rows import NO_TIME_MODEL, Row, identity_row, judge, reaches, row, upper_bound_row
from ledger.reconcile.run import Reconciliation, reconcile
from ledger.reconcile.step_decomposition import StepDecomposition
from ledger.reconcile.throughput import throughput_rows
from ledger.reconcile.topology import groups_rows
from tests.fixtures.synthetic_run import Spec, make_run
from tests.support.ring_calibration import attention_records, cp_send_recv_record


@dataclass
class Base:
    ev: RunEvidence
    summaries: dict[int, TraceSummary]


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Base:
    # steps long enough that the exposed figures (tens of ms) lie beyond the rows' absolute floors
    run, _ = make_run(tmp_path_factory.mktemp("verdicts") / "run", Spec(t_fwd=20e-3, t_bwd=40e-3, t_opt=40e-3))
    ev = read_run(run)
    return Base(ev, {t.rank: summarize(t.path) for t in ev.traces})


# --- perturbations of the measurement -------------------------------------------------------------------------------
def scale_memory(key: str, factor: float, point: str | None = None) -> Callable[[RunEvidence], None]:
    def apply(ev: RunEvidence) -> None:
        for r in ev.ranks.values():
            records = [r.memory_points[point]] if point else list(r.memory_points.values()) + r.memory_steps
            for m in records:
                if key in m.stats:
                    m.stats[key] = int(m.stats[key] * factor)
    return apply


def set_memory(key: str, value: int) -> Callable[[RunEvidence], None]:
    def apply(ev: RunEvidence) -> None:
        for r in ev.ranks.values():
            for m in r.memory_steps:
                m.stats[key] = value
    return apply


def timings(ev: RunEvidence, stage: int | None = None, category: str | None = None):
    return [t for r in ev.ranks.values() if stage is None or r.stage == stage for t in r.timing
            if category is None or t.category == category]


def stretch(t: TimingRecord, factor: float) -> None:
    """Make a timed range `factor` times as long, on both clocks."""
    t.end_s = t.start_s + (t.end_s - t.start_s) * factor
    if t.t_start is not None and t.t_end is not None:
        t.t_end = t.t_start + (t.t_end - t.t_start) * factor


def shift(t: TimingRecord, by: float) -> None:
    t.start_s, t.end_s = t.start_s + by, t.end_s + by
    if t.t_start is not None and t.t_end is not None:
        t.t_start, t.t_end = t.t_start + by, t.t_end + by


def delay_stage(stage: int, by: float) -> Callable[[RunEvidence], None]:
    def apply(ev: RunEvidence) -> None:
        for kind in ("forward", "backward"):
            for t in timings(ev, stage, kind):
                shift(t, by)
    return apply


def stretch_kind(kind: str, factor: float, stage: int | None = None) -> Callable[[RunEvidence], None]:
    def apply(ev: RunEvidence) -> None:
        for t in timings(ev, stage, kind):
            stretch(t, factor)
    return apply


def comm_records(ev: RunEvidence, bucket: int | None = None, op: str = "reduce-scatter"):
    return [t for t in timings(ev, category="dp-comm") if t.name.startswith(op)
            and (bucket is None or t.bucket == bucket)]


def move_comm_after_compute(bucket: int) -> Callable[[RunEvidence], None]:
    def apply(ev: RunEvidence) -> None:
        for t in comm_records(ev, bucket):
            shift(t, 1.0)  # a second later: past every compute range of its step
    return apply


def hide_comm_in_compute(ev: RunEvidence) -> None:
    """Every DP collective shrunk to the first microsecond of its step's first backward: nothing exposed."""
    for r in ev.ranks.values():
        first = {}
        for t in r.timing:
            if t.category == "backward":
                first[t.step] = min(first.get(t.step, t.start_s), t.start_s)
        for t in r.timing:
            if t.category == "dp-comm":
                t.start_s, t.end_s = first[t.step], first[t.step] + 1e-6


def scale_comm_bytes(factor: float) -> Callable[[RunEvidence], None]:
    def apply(ev: RunEvidence) -> None:
        for t in timings(ev):
            if t.bytes is not None:
                t.bytes = int(t.bytes * factor)
    return apply


def slow_steps(factor: float, rank: int | None = None) -> Callable[[RunEvidence], None]:
    def apply(ev: RunEvidence) -> None:
        for r in ev.ranks.values():
            if rank is None or r.rank == rank:
                for s in r.steps:
                    s.step_time_s = (s.step_time_s or 0.0) * factor
    return apply


def slow_loader(ev: RunEvidence) -> None:
    """Every step of every rank waited 100 ms for its data: a loader that does not keep ahead."""
    for r in ev.ranks.values():
        for s in r.steps:
            s.data_wait_s = 0.1


def with_groups(ev: RunEvidence) -> None:
    """The groups each rank joined, as the engine records them in the manifest: Megatron's, unless set already."""
    lists = group_lists(ev.layout)
    for rank, info in ev.rank_infos.items():
        if info.groups is None:
            info.groups = {k: next(g for g in v if rank in g) for k, v in lists.items() if any(rank in g for g in v)}


def wrong_groups(ev: RunEvidence) -> None:
    with_groups(ev)
    ev.rank_infos[1].groups["dp"] = [1, 2]


def trace_kernels(factor: float = 1.0, by_us: float = 0.0, op: str = "reduce_scatter"):
    def apply(summaries: dict[int, TraceSummary]) -> None:
        for s in summaries.values():
            for c in s.collectives:
                if c.op == op:
                    c.end = c.start + (c.end - c.start) * factor + by_us
    return apply


def double_p2p(summaries: dict[int, TraceSummary]) -> None:
    for s in summaries.values():
        for p in s.p2p:
            p.elements *= 2


# --- builders -------------------------------------------------------------------------------------------------------
def timer_rows(ev: RunEvidence, predicted: dict) -> list[Row]:
    selection = run_steps(ev)
    return [x for r in ev.ranks.values() for x in overlap_rows(ev.config, r, selection, False, **predicted)]


def trace_rows(ev: RunEvidence, summaries: dict[int, TraceSummary], predicted: dict) -> list[Row]:
    selection = run_steps(ev)
    return [x for rank, s in summaries.items()
            for x in trace_overlap_rows(ev.config, ev.ranks[rank], s, ev.groups(rank), selection,
                                        **predicted)]


def traced_volume(ev: RunEvidence, summaries: dict[int, TraceSummary], _: dict) -> list[Row]:
    return [x for rank, s in summaries.items()
            for x in volume_rows(ev.config, ev.ranks[rank],
                                 trace_volume(s, ev.groups(rank), p2p_element_bytes(ev.config)))]


def counted_volume(ev: RunEvidence, *_) -> list[Row]:
    return [x for r in ev.ranks.values() for x in volume_rows(ev.config, r, None)]


@dataclass
class Case:
    metric: str
    where: dict
    build: Callable[[RunEvidence, dict[int, TraceSummary], dict], list[Row]]  # (evidence, traces, predictions)
    perturb_ev: Callable[[RunEvidence], None] | None = None
    perturb_trace: Callable[[dict[int, TraceSummary]], None] | None = None
    predicted: Callable[[list[Row]], dict] | None = None  # the time model's figure: the clean measurement

    def rows(self, base: Base, perturbed: bool, predicted: dict) -> list[Row]:
        ev, summaries = copy.deepcopy(base.ev), copy.deepcopy(base.summaries)
        if perturbed and self.perturb_ev:
            self.perturb_ev(ev)
        if perturbed and self.perturb_trace:
            self.perturb_trace(summaries)
        return self.build(ev, summaries, predicted)


def memory(ev, *_):
    return memory_rows(ev)


def pipeline(ev, *_):
    return pipeline_rows(ev)


def topology(ev, *_):
    with_groups(ev)
    return groups_rows(ev)


def bucket_prediction(metric: str, source: str):
    op = metric.split(".")[1]
    return lambda rows: {"predicted_exposed": {(op, r.bucket): r.measured for r in rows
                                               if r.metric == metric and r.source == source}}


def step_prediction(rows):
    exposed = next(r.measured for r in rows if r.metric == "overlap.exposed_dp_comm_per_step")
    return {"predicted_per_step": {"dp": exposed}}


def timers(ev, _, predicted):
    return timer_rows(ev, predicted)


def traced(ev, summaries, predicted):
    return trace_rows(ev, summaries, predicted)


def throughput(ev, _, predicted):
    return throughput_rows(ev, run_steps(ev), **predicted)


def data_wait(ev, *_):
    """The synthetic run has no loader: each step gets a clean wait of 50 us, unless the perturbation set one."""
    for r in ev.ranks.values():
        for s in r.steps:
            if s.data_wait_s is None:
                s.data_wait_s = 50e-6
    return data_wait_rows(ev, run_steps(ev))


def step_replay(ev, summaries, _):
    decomposition = StepDecomposition(ev)
    for rank, _, _, path in ev.traces:
        decomposition.add(ev.ranks[rank], summaries[rank], path)
    return decomposition.rows(choice=RankChoice("all"))[0]


def late_sync(ev: RunEvidence) -> None:
    """Rank 0 syncs in each step's longest host idle after a launch (the pipeline bubble), for the kernel just
    launched: in steps 1 and 2 the sync returns 10 µs after that kernel ends, in step 3 just before the next launch
    (waiting for something the trace does not hold). The replay returns it 10 µs (the median wake-up) after the
    kernel, so step 3 replays shorter than its window by most of that idle (40 ms of 380)."""
    rank, a, b, path = next(t for t in ev.traces if t[0] == 0)
    with gzip.open(path, "rt") as f:
        doc = json.load(f)
    events = doc["traceEvents"]
    kernels = {e["args"]["correlation"]: e for e in events if e.get("cat") == "kernel"}
    windows = sorted((e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("Profiler")),
                     key=lambda e: e["ts"])
    for n, window in enumerate(windows, start=1):
        launches = sorted((e for e in events if e.get("name") == "cudaLaunchKernel"
                           and window["ts"] <= e["ts"] < window["ts"] + window["dur"]), key=lambda e: e["ts"])
        ends = [kernels[x["args"]["correlation"]]["ts"] + kernels[x["args"]["correlation"]]["dur"] for x in launches]
        done, call, after = max(zip(ends, launches, launches[1:]), key=lambda t: t[2]["ts"] - t[0])
        returns = done + 10 if n < 3 else after["ts"] - 10
        events.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "pid": 100, "tid": 1,
                       "ts": call["ts"] + 2, "dur": returns - call["ts"] - 2, "args": {}})
    late = path.parent.parent.parent / "rank0.late_sync.json.gz"  # beside the run: its traces/ stays as it was
    with gzip.open(late, "wt") as f:
        json.dump(doc, f)
    ev.traces = [(rank, a, b, late) if t[0] == 0 else t for t in ev.traces]


RANK2 = dict(rank=2)
CASES = {
    "static after optimizer init": Case("memory.static_after_optimizer_init", RANK2, memory,
                                        scale_memory(ALLOCATED, 1.5, "after_optimizer_init")),
    "static after first step": Case("memory.static_after_first_step", RANK2, memory,
                                    scale_memory(ALLOCATED, 1.5, "after_first_step")),
    "adam lazy state": Case("memory.adam_lazy_state", RANK2, memory, scale_memory(ALLOCATED, 1.5, "after_first_step")),
    "bytes per param": Case("memory.bytes_per_param", RANK2, memory, scale_memory(ALLOCATED, 1.5, "after_first_step")),
    "peak allocated": Case("memory.peak_allocated", RANK2, memory, scale_memory(PEAK, 2.0)),
    "fragmentation": Case("memory.fragmentation", RANK2, memory, scale_memory(RESERVED, 3.0)),
    "alloc retries": Case("memory.alloc_retries", RANK2, memory, set_memory("num_alloc_retries", 1000)),
    "ooms": Case("memory.ooms", RANK2, memory, set_memory("num_ooms", 1)),
    "rank groups": Case("topology.rank_groups", dict(rank=1), topology, wrong_groups),
    "bubble of wall time": Case("pipeline.bubble_of_wall_time", dict(rank=0), pipeline, delay_stage(1, 0.5)),
    "bubble relative to compute": Case("pipeline.bubble_relative_to_compute", dict(rank=0), pipeline,
                                       delay_stage(1, 0.5)),
    "stage time share": Case("pipeline.stage_time_share", dict(rank=2), pipeline, stretch_kind("backward", 3.0, 1)),
    "backward over forward": Case("pipeline.backward_over_forward", dict(rank=0), pipeline,
                                  stretch_kind("backward", 3.0)),
    "bytes per step (trace)": Case("comm.pp.send_recv.bytes_per_step", dict(rank=0), traced_volume,
                                   perturb_trace=double_p2p),
    "bytes per step (counters)": Case("comm.dp.reduce_scatter.bytes_per_step", dict(rank=0), counted_volume,
                                      scale_comm_bytes(2.0)),
    "overlapped fraction (timers)": Case("overlap.reduce_scatter.overlapped_fraction", dict(rank=0, bucket=0),
                                         timers, move_comm_after_compute(0)),
    "overlapped fraction (trace)": Case("overlap.reduce_scatter.overlapped_fraction", dict(rank=0, bucket=0),
                                        traced, perturb_trace=trace_kernels(by_us=1e6)),
    "exposed time (timers)": Case("overlap.reduce_scatter.exposed_time", dict(rank=0, bucket=1), timers,
                                  hide_comm_in_compute,
                                  predicted=bucket_prediction("overlap.reduce_scatter.exposed_time", "timers")),
    "exposed time (trace)": Case("overlap.reduce_scatter.exposed_time", dict(rank=0, bucket=1), traced,
                                 perturb_trace=trace_kernels(by_us=1e4),
                                 predicted=bucket_prediction("overlap.reduce_scatter.exposed_time", "trace")),
    "comm time (timers)": Case("overlap.reduce_scatter.comm_time", dict(rank=1, bucket=0), timers,
                               stretch_kind("dp-comm", 0.1)),
    "comm time (trace)": Case("overlap.reduce_scatter.comm_time", dict(rank=1, bucket=0), traced,
                              perturb_trace=trace_kernels(factor=4.0)),
    "exposed comm per step (timers)": Case("overlap.exposed_dp_comm_per_step", dict(rank=0), timers,
                                           hide_comm_in_compute, predicted=step_prediction),
    "exposed comm per step (trace)": Case("overlap.exposed_dp_comm_per_step", dict(rank=0), traced,
                                          perturb_trace=trace_kernels(by_us=1e5), predicted=step_prediction),
    "step time": Case("throughput.step_time", {}, throughput, slow_steps(2.0),
                      predicted=lambda rows: {"predicted_step_time": next(r.measured for r in rows
                                                                          if r.metric == "throughput.step_time")}),
    "step time against the other ranks": Case("throughput.step_time_vs_other_ranks", dict(rank=3), throughput,
                                              slow_steps(1.5, rank=3)),
    "step time spread": Case("throughput.step_time_spread", {}, throughput, slow_steps(1.5, rank=3)),
    "data wait per step": Case("time.data_wait_per_step", dict(rank=0), data_wait, slow_loader),
    "step replay": Case("step.replay", dict(rank=0, step=3), step_replay, late_sync),
}


def pick(rows: list[Row], case: Case) -> Row:
    found = [r for r in rows if r.metric == case.metric and all(getattr(r, k) == v for k, v in case.where.items())]
    assert len(found) == 1, (case.metric, case.where, found)
    return found[0]


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_wrong_measurement_is_off(base, name):
    case = CASES[name]
    predicted = case.predicted(case.rows(base, False, {})) if case.predicted else {}
    clean = pick(case.rows(base, False, predicted), case)
    assert clean.verdict == "ok", clean
    wrong = pick(case.rows(base, True, predicted), case)
    assert wrong.verdict == "off", wrong


def test_every_judged_row_type_of_a_full_reconciliation_has_a_case(base):
    """A new judged row type without a case above fails here (identity and n/a-only rows are not judged). The time
    model's own rows ("time.*") have their can-be-off tests beside the model (tests/test_h200_claims.py), and
    memory.outside_pytorch on real H200 runs (tests/test_device_memory.py)."""
    from ledger.reconcile.run import reconcile

    result = reconcile(base.ev.run_dir)
    judged = {family(r.metric) for r in result.rows if r.verdict in ("ok", "warn", "off")
              and not r.metric.startswith("time.")}
    covered = {family(c.metric) for c in CASES.values()} | {"overlap.hta_comm_comp_overlap", "memory.outside_pytorch"}
    assert judged <= covered


def family(metric: str) -> str:
    """A row type: the metric without the group or collective it is about."""
    parts = metric.split(".")
    if parts[0] == "comm":
        return "comm.*.*." + parts[-1]
    if parts[0] == "overlap" and len(parts) == 3:
        return f"overlap.*.{parts[2]}"
    if metric.startswith("overlap.exposed_"):
        return "overlap.exposed_*_comm_per_step"
    return metric


@pytest.mark.skipif(not available(), reason="HolisticTraceAnalysis not installed")
def test_the_hta_cross_check_is_off_when_the_ledgers_figure_disagrees(base):
    path = Path(base.summaries[0].path)
    (clean,), _ = hta_rows({0: CrossCheck(path, True, None)})
    (agree,), _ = hta_rows({0: CrossCheck(path, True, clean.measured)})
    (wrong,), _ = hta_rows({0: CrossCheck(path, True, clean.measured + 0.5)})
    assert (agree.verdict, wrong.verdict) == ("ok", "off")


def test_an_absolute_floor_forgives_small_gaps_only():
    # 1 ms against 0.5 ms is 100% off in relative terms but within a 2 ms floor; 10 ms against 0.5 ms is not
    assert judge(1e-3, 0.5e-3, 0.25, 2e-3)[2] == "ok"
    assert judge(5e-3, 0.5e-3, 0.25, 2e-3)[2] == "warn"  # within 3 x the floor
    assert judge(10e-3, 0.5e-3, 0.25, 2e-3)[2] == "off"
    assert judge(0.0, 0.0, 0.25)[2] == "ok" and judge(1.0, 0.0, 0.25)[2] == "off"


@pytest.mark.parametrize("measured, verdict", [(0.4, "off"), (0.8, "ok"), (1.2, "ok"), (3.0, "n/a")])
def test_an_upper_bound_below_its_prediction_is_off_and_above_it_says_what_it_cannot_tell(measured, verdict):
    r = upper_bound_row("overlap.x.comm_time", "bucket", predicted=1.0, measured=measured, unit="s", tolerance=0.5,
                        explanation="e", judged_elsewhere="the trace row")
    assert r.verdict == verdict
    if verdict == "n/a":
        assert "cannot tell a slower collective from a wait that came late" in r.explanation
        assert r.explanation.endswith("the trace row judges it")
    if verdict == "off":
        assert "the true figure is lower still" in r.explanation


def test_an_upper_bounds_caveat_is_one_clause_for_every_gap():
    """The gap is in the row's columns; the caveat reads the same at 2x and 300x (no "29011% above the prediction"),
    so a report states it once, as a numbered note."""
    texts = {upper_bound_row("overlap.x.comm_time", "bucket", predicted=1.0, measured=m, unit="s", tolerance=0.5,
                             explanation="e", judged_elsewhere="the trace row").explanation for m in (2.0, 291.11)}
    assert len(texts) == 1 and "%" not in texts.pop()


def test_identity_rows_are_never_agreement_nor_failure():
    rows = [identity_row("memory.device_total", "rank", measured=5.0, unit="bytes", explanation="sum of its terms"),
            row("m", "rank", predicted=1.0, measured=1.0, unit="s", tolerance=0.1, explanation="")]
    result = Reconciliation(run_dir=Path("."), run={}, rows=rows)
    assert result.verdict_counts() == {"ok": 1, "warn": 0, "off": 0, "n/a": 0, "identity": 1}
    assert not reaches(rows, "warn")


def test_a_row_without_its_time_model_prediction_says_so(base):
    rows = timer_rows(copy.deepcopy(base.ev), {})
    exposed = [r for r in rows if r.metric == "overlap.exposed_dp_comm_per_step"]
    assert exposed and all(r.verdict == "n/a" and NO_TIME_MODEL in r.explanation for r in exposed)


def test_the_pp_groups_exposed_time_says_why_it_is_not_judged_not_that_a_sweep_is_missing():
    """A real 2-stage gloo run with both sweeps: its pp rows hold the wait for the peer stage (the pipeline rows judge
    that), which is why they are not compared; they once said the time model needed the sweeps this run has."""
    result = reconcile(Path(__file__).parent / "fixtures" / "gloo_pp2_sweeps")
    pp = [r for r in result.rows if r.metric == "overlap.exposed_pp_comm_per_step"]
    assert pp and all(r.verdict == "n/a" for r in pp)
    assert all(NOT_COMPARED in r.explanation and NO_TIME_MODEL not in r.explanation for r in pp)


# --- context parallel: ring attention's exchanges ------------------------------------------------------------------
def ring_exchanges(waited: float) -> Callable[[RunEvidence], None]:
    """A CP 2 run: each forward of the synthetic run gets one ring exchange ("cp-comm", issue -> wait returned) over
    its middle half, whose last `waited` share is a "cp-wait" stall, and each rank a calibration in which every
    block (1 ms forward, 2.5 ms backward) outlasts its transfer (0.1 ms): predicted all hidden. Plumbing only: the
    figures are made up."""
    def apply(ev: RunEvidence) -> None:
        cfg = ev.config
        cfg.parallel.context_parallel_size = 2
        for r in ev.ranks.values():
            r.compute += attention_records(cfg, seq=local_seq_length(cfg), forward_s=1e-3, backward_s=2.5e-3)
            r.bandwidth.append(cp_send_recv_record(cfg, 1e-4))
            added = []
            for t in r.timing:
                if t.category == "forward":
                    lo, hi = t.start_s, t.end_s
                    start, end = lo + (hi - lo) / 4, lo + 3 * (hi - lo) / 4
                    added.append(TimingRecord(step=t.step, name="cp sendrecv kv forward step0", category="cp-comm",
                                              start_s=start, end_s=end, bytes=8192, async_comm=True))
                    added.append(TimingRecord(step=t.step, name="wait cp sendrecv kv forward step0",
                                              category="cp-wait", start_s=end - waited * (end - start), end_s=end))
            r.timing.extend(added)
    return apply


def cp_timers(ev: RunEvidence, summaries: dict, predicted: dict) -> list[Row]:
    """The clean CP run waits for 5% of each exchange, unless the perturbation made its exchanges already."""
    if not timings(ev, category="cp-comm"):
        ring_exchanges(0.05)(ev)
    return timers(ev, summaries, predicted)


CP_CASE = Case("overlap.cp_exchange.hidden_fraction", dict(rank=0), cp_timers, perturb_ev=ring_exchanges(0.9))
CASES["cp exchange hidden fraction (timers)"] = CP_CASE


def test_a_ring_exchange_that_is_not_hidden_is_off(base):
    """Clean: 5% of each exchange waited for (hidden 0.95, ok against the 1.0 its calibration predicts: every
    block outlasts its transfer). Wrong: 90% waited for, a tenth hidden: off."""
    clean = pick(CP_CASE.rows(base, False, {}), CP_CASE)
    assert clean.verdict == "ok" and clean.predicted == 1.0 and clean.measured == pytest.approx(0.95)
    wrong = pick(CP_CASE.rows(base, True, {}), CP_CASE)
    assert wrong.verdict == "off" and wrong.measured == pytest.approx(0.1), wrong
