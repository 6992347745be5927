"""Where the host is in an unprofiled step (docs/formulas.md, "Host timeline"): the timers' host times beside their
device times, and the host timeline's forward and backward ranges judged against them
(time.host_{forward,backward}_per_microbatch). Claims on six real H200 runs recorded after the rows were written
(tests/fixtures/h200_host_ranges, held out); the row's plumbing on a copy with its host times changed."""
from __future__ import annotations

import json
import shutil
from functools import lru_cache
from pathlib import Path
from statistics import median

import pytest

from ledger.evidence.read import read_run
from tests.support.recorded_runs import FIXTURES, only, reconcile_recorded
from tests.support.records import copy_without

RUNS = FIXTURES / "h200_host_ranges"
NAMES = ["lb_h1024_l4_s512", "lb_h1024_l4_s512_graphed", "lb_h512_l12_s256_graphed", "llama1b_l2_s1024",
         "llama1b_s2048_gbs4", "llama1b_s4096"]
MOE = ["mixtral-8x7b-2l"]  # the grouped MoE runs: tests/test_h200_moe_grouped.py
HOST_ROWS = ("time.host_forward_per_microbatch", "time.host_backward_per_microbatch")


@lru_cache(maxsize=None)
def rows(name: str) -> dict[str, object]:
    return {r.metric: r for r in reconcile_recorded(RUNS / name).rows if r.metric.startswith("time.")}


def ranges(name: str, category: str, steps: range) -> list:
    return [t for r in read_run(RUNS / name).ranks.values() for t in r.timing
            if t.category == category and t.step in steps]


@pytest.mark.parametrize("name", NAMES + MOE)
def test_the_host_and_device_clocks_share_the_steps_origin(name: str):
    # A step begins with the device drained (the last step's reads), so a range reaches the device after the host
    # opened it (here 12-18 µs at least) and closes there no earlier than the host's closing call, give or take the
    # call itself (the host's clock is read after the event is recorded).
    timed = [t for r in read_run(RUNS / name).ranks.values() for t in r.timing if t.step is not None]
    assert timed and all(t.clock == "cuda_event" for t in timed)
    assert min(t.start_s - t.host_start_s for t in timed) > 10e-6
    assert min(t.end_s - t.host_end_s for t in timed) > -0.1e-3


@pytest.mark.parametrize("name", NAMES)
def test_the_host_forward_is_predicted_within_its_tolerance_on_every_held_out_run(name: str):
    # (-19% to +11%; the tolerance, 25% as docs/formulas.md "Tolerances" gives it, written out here)
    row = rows(name)["time.host_forward_per_microbatch"]
    assert row.predicted is not None and row.verdict == "ok" and abs(row.rel_diff) <= 0.25
    assert row.tolerance == 0.25 and rows(name)["time.host_backward_per_microbatch"].tolerance == 0.25


def test_the_host_backward_is_predicted_where_the_sweep_timed_it_as_the_step_runs_it():
    # Graphed layers and the 16-layer seq-2048 run: the backward's issue within 20%.
    for name in ("lb_h1024_l4_s512_graphed", "lb_h512_l12_s256_graphed", "llama1b_s2048_gbs4"):
        row = rows(name)["time.host_backward_per_microbatch"]
        assert row.verdict == "ok" and abs(row.rel_diff) < 0.2


def test_a_host_bound_steps_backward_is_short_where_the_host_ran_slower_than_at_its_start_up_sweep():
    # What the host rows miss on the compiled host-bound runs (BENCHMARKS.md): the backward the host sweep timed at
    # start-up (pass.backward, 3.4 and 5.0 ms) took 1.3-1.6x that in the steps, the device never behind (the range's
    # device end within 0.1 ms of the host's): the host's own pace, which moves that much from run to run (below).
    for name, low, high in (("lb_h1024_l4_s512", 1.25, 1.45), ("llama1b_l2_s1024", 1.4, 1.65)):
        run = read_run(RUNS / name)
        (swept,) = {h.seconds for r in run.ranks.values() for h in r.host if h.op == "pass.backward"}
        spans = ranges(name, "backward", range(3, 13))
        assert low < median(t.host_end_s - t.host_start_s for t in spans) / swept < high
        assert median(t.end_s - t.host_end_s for t in spans) < 0.1e-3
        assert rows(name)["time.host_backward_per_microbatch"].verdict != "ok"


def test_the_hosts_pace_moves_by_a_third_between_runs_minutes_apart_on_one_lease():
    # Eight runs of the two shapes one after another (tests/fixtures/h200_host_pace): the start-up sweep's
    # pass.backward spreads over 1.5x across a shape's four runs and the steps' own backward issue against it from
    # 0.68x to 1.45x, with no order among NVTX on or off, the garbage collector on or off, the other probes on or off.
    # So a host-bound step is known to a third from a sweep of its host taken minutes before, not to 5%.
    pace = FIXTURES / "h200_host_pace"
    ratios = []
    for shape in ("lb", "L2"):
        swept = []
        for way in ("timers", "nvtx", "nogc", "all"):
            run = read_run(pace / f"{shape}_{way}")
            (backward,) = {h.seconds for r in run.ranks.values() for h in r.host if h.op == "pass.backward"}
            issue = median(t.host_end_s - t.host_start_s for r in run.ranks.values() for t in r.timing
                           if t.category == "backward" and t.step is not None and t.step >= 3)
            swept.append(backward)
            ratios.append(issue / backward)
        assert max(swept) / min(swept) > 1.4
    assert min(ratios) < 0.8 and max(ratios) > 1.3


def test_the_dense_hosts_lead_stops_at_the_launch_queue_and_its_backward_issue_doubles():
    # llama3.2-1b at seq 4096: the host issues faster than the device computes, so its lead grows through the first
    # micro-batches, then stays at ~85-91 ms of device work (about a thousand launches: the launch queue is full and
    # each launch waits for a slot), and from then on the backward's issue takes the device's pace, not the host's.
    steps = range(3, 9)
    lead = [t.end_s - t.host_end_s for t in ranges("llama1b_s4096", "backward", steps)]
    assert 0.08 < max(lead) < 0.1
    issue = {m: median(t.host_end_s - t.host_start_s for t in ranges("llama1b_s4096", "backward", steps)
                       if t.microbatch == m) for m in range(8)}
    assert all(0.022 < issue[m] < 0.027 for m in range(1, 4))
    assert all(0.040 < issue[m] < 0.046 for m in range(4, 8))


def test_the_host_timeline_holds_the_dense_host_at_its_launch_queue():
    # The same run as the time model sees it: the host at most LAUNCH_QUEUE kernels ahead, so its later backwards
    # take the device's pace; the mean over the step's backwards, 28.1 ms, lands 15% under the measured median, 32.9
    # (without the queue the model's 23.6 ms issue was 28% short; with the device at the sweep's full-load power
    # factor, 30.3 ms: the queued host waits on a device now priced at the factor of the step's share, x1.09,
    # docs/formulas.md "The power limit in a step").
    row = rows("llama1b_s4096")["time.host_backward_per_microbatch"]
    assert row.verdict == "ok" and 0.10 < row.rel_diff < 0.20
    # the row says how far behind the device was: the queue's depth here, nothing on a host-bound run
    assert "87.8 ms behind the host" in row.explanation
    assert "0 ms behind the host" in rows("lb_h1024_l4_s512")["time.host_backward_per_microbatch"].explanation


def test_the_moe_hosts_miss_is_where_its_counts_are_not_read():
    # mixtral-8x7b-2l, held out. SequentialMLP reads each layer's token counts on the host, which holds its forward to
    # the device (the forward's issue 27.8 ms against 34.7 predicted: ok), and its 16 experts' backward issues 22 ms a
    # micro-batch against the recipes' 8 (their linears' backward nodes take 251 µs at the median and up to 6.7 ms in
    # the committed profiled trace, the first GEMM at a row count new to cuBLAS).
    sequential = rows(MOE[0])
    assert sequential["time.host_forward_per_microbatch"].verdict == "ok"
    assert 2.5 < sequential["time.host_backward_per_microbatch"].measured / \
        sequential["time.host_backward_per_microbatch"].predicted < 3.0


def test_a_host_range_row_measures_the_timers_host_times_and_predicts_from_the_model(tmp_path: Path):
    # Plumbing (a copy whose host times are stretched 2x): the measured host ranges double, the prediction does not
    # move, so the row judges the model against the run and is not built from it.
    run = tmp_path / "run"
    shutil.copytree(RUNS / "lb_h1024_l4_s512_graphed", run)
    events = run / "ranks" / "rank0" / "events.jsonl"
    lines = []
    for line in events.read_text().splitlines():
        record = json.loads(line)
        if record.get("kind") == "timing" and record.get("host_start_s") is not None:
            record["host_end_s"] = record["host_start_s"] + 2 * (record["host_end_s"] - record["host_start_s"])
        lines.append(json.dumps(record))
    events.write_text("\n".join(lines) + "\n")
    stretched = {r.metric: r for r in reconcile_recorded(run).rows if r.metric in HOST_ROWS}
    for metric in HOST_ROWS:
        before = rows("lb_h1024_l4_s512_graphed")[metric]
        assert stretched[metric].predicted == pytest.approx(before.predicted)
        assert stretched[metric].measured == pytest.approx(2 * before.measured, rel=1e-6)
        assert stretched[metric].verdict == "off"


def test_the_one_gpu_demos_host_is_priced_from_the_passes_it_timed(tmp_path: Path):
    """The demo's one-GPU run (`demo_1gpu`: --overlap-param-gather at DP 1, the profiler window at steps 2-3, the host
    rows judged on steps 5-12; held out, recorded after the passes were timed there). Priced from the passes its sweep
    timed at start-up: the forward's issue within its 25% (-17%), the backward within warn (+55%). From the
    primitives' recipes alone (the sweep without its pass.* records, as the demo was priced before) both are off,
    the forward measured at over twice the prediction."""
    def host_rows(run: Path) -> tuple:
        return tuple(only(reconcile_recorded(run), metric) for metric in HOST_ROWS)
    forward, backward = host_rows(RUNS / "demo_1gpu")
    assert forward.verdict == "ok" and abs(forward.rel_diff) <= 0.25 and 0.25 < backward.rel_diff < 0.75
    bare = copy_without(RUNS / "demo_1gpu", tmp_path / "demo_1gpu", lambda e: str(e.get("op", "")).startswith("pass."))
    forward, backward = host_rows(bare)
    assert forward.verdict == backward.verdict == "off" and forward.rel_diff > 1.0
