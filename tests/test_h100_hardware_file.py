"""The H100 hardware file, measured on H100s (runs/bench/hardware_calibration.sh), judged on twelve H100 runs: its
kernel curves come from a grid sweep alone, its power limit from a kernel loop, its host block from one calibration
run's trace and its host contexts from three calibration runs (tests/fixtures/h100_host_calibration), its memory
outside PyTorch from a separate program. Six runs (tests/fixtures/h100_new_shapes) were read before the contexts took
their final form, so they are in-sample for it; six more (tests/fixtures/h100_second_shapes) were predicted from that
form and committed before they ran.

- GPU-bound shapes: the step within 3.5%; the graphed shape and the eager launch-bound one at seq 256 within 5%, the
  issue's launch-bound shape within 6% (its host issued its forward 20% slower than the block prices it);
- every peak within 0.2%;
- the host block's backward needs no context: on the calibration run, whose backward the host paces, the recipes'
  calls at the block's profiled prices add up to the profiled backward ranges on the host clock; over three runs of
  that shape the backward's fitted context holds still while the forward's moves by half;
- memory outside PyTorch on an H100 run is judged, from the H100's own calibration;
- of the six predicted before they ran, four land within 5%, two hosts slower than the file prices 19-21% short.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from statistics import median

import pytest

from common.arguments import parse_args
from common.config import RunConfig
from ledger.evidence.read import read_run
from ledger.models.simulate import hardware_calibration, load_hardware
from ledger.models.simulate.hardware import HARDWARE_DIR
from ledger.models.time_model import host_recipe, predict_step
from ledger.models.time_model.ops import chunk_backward
from ledger.reconcile.validation import Validation, validate_run
from tests.support.bench import assert_refused, bench_script
from tests.support.recorded_runs import FIXTURES, only, reconcile_recorded

RUNS = FIXTURES / "h100_new_shapes"
CALIBRATION = FIXTURES / "h100_host_calibration" / "l2_s1024"  # the profiled one, whose trace priced the block
CALIBRATION_RUNS = [CALIBRATION] + [FIXTURES / "h100_host_calibration" / f"l2_repeat{i}" for i in (1, 2)]


@functools.cache
def validation(name: str) -> Validation:
    return validate_run(RUNS / name)


def stored_contexts() -> dict:
    return json.loads((HARDWARE_DIR / "h100.json").read_text())["host"]["engine_contexts"]


@pytest.mark.parametrize("name", ["h1_llama1b_s4096", "pw_llama8b_l2_s8192", "pw_h5120_l2_s2048_mbs2"])
def test_a_gpu_bound_shape_is_predicted_within_three_and_a_half_percent(name):
    assert validation(name).sim.hardware.name == "H100"
    assert abs(validation(name).errors()["step_time"]) < 0.035


@pytest.mark.parametrize("name", ["ss_h1024_l8_s256_mbs8_graphed", "ss_h1024_l6_s256_mbs8"])
def test_the_graphed_and_the_eager_seq_256_shapes_are_predicted_within_the_goal(name):
    assert abs(validation(name).errors()["step_time"]) < 0.05


def test_the_issues_launch_bound_shape_is_predicted_within_six_percent():
    # -5.2%: its host issued its forward 20% slower than the file's block prices it (the table's "host forward")
    v = validation("lb_h1024_l8_s1024_mbs4")
    assert abs(v.errors()["step_time"]) < 0.06 and v.errors()["host_forward"] < -0.15


@pytest.mark.parametrize("name", sorted(p.name for p in RUNS.iterdir() if p.is_dir()))
def test_every_peak_is_predicted_within_a_fifth_of_a_percent(name):
    assert abs(validation(name).errors()["peak_bytes"]) < 0.002


def test_the_calibration_runs_backward_on_the_host_is_its_calls_alone():
    # The profiled steps' backward ranges on the host clock against the backward recipe's calls at the block's
    # profiled prices (torch.autograd.backward's own call included): level, so no Python beyond them to price.
    ev = read_run(CALIBRATION)
    profiled = {s.step for r in ev.ranks.values() for s in r.steps if s.profiled}
    measured = median(t.host_end_s - t.host_start_s for r in ev.ranks.values() for t in r.timing
                      if t.category == "backward" and t.step in profiled)
    host = load_hardware("H100").host
    calls = host_recipe.sum_of(host_recipe.BACKWARD_START,
                               *(host_recipe.entry(w, False) for w in chunk_backward(ev.config, 0, 0)))
    priced = sum(n * host.profiled[k] for k, n in calls.items())
    assert priced == pytest.approx(measured, rel=0.03)


def test_the_contexts_are_the_median_of_the_calibration_runs_fits_whose_forward_pace_moves_and_backward_does_not():
    # Three runs of the calibration shape on two leases: the backward's context lands within 4% each time (autograd's
    # C++ engine), the forward's moves by half (its Python: 0.93 to 1.42); the file takes each pass's median.
    script = bench_script("host_contexts")
    fits = [script.fit(read_run(run), "H100") for run in CALIBRATION_RUNS]
    backward, forward = sorted(f["backward"] for f in fits), sorted(f["forward"] for f in fits)
    assert backward[-1] / backward[0] < 1.04 and forward[-1] / forward[0] > 1.4
    stored = stored_contexts()
    assert all(run.name in stored["source"] for run in CALIBRATION_RUNS)
    assert stored == {"forward": pytest.approx(forward[1], abs=1e-3), "backward": pytest.approx(backward[1], abs=1e-3),
                      "source": stored["source"]}


def host_ranges(cfg: RunConfig, contexts: tuple[float, float] | None) -> dict[str, float]:
    cal = hardware_calibration(cfg, load_hardware("H100"))
    cal = dataclasses.replace(cal, host=dataclasses.replace(cal.host, engine_contexts=contexts))
    return predict_step(cfg, cal).stages[0].host_ranges


def test_the_contexts_price_this_engines_passes_and_leave_megatrons_alone():
    small = parse_args(["--model", "llama3.2-1b", "--num-layers", "2", "--seq-length", "1024", "--bf16",
                        "--global-batch-size", "4", "--world-size", "1"])
    default = host_ranges(small, None)
    backward_only = host_ranges(small, (host_recipe.CONTEXT, 1.0))
    assert backward_only["F"] == pytest.approx(default["F"]) and backward_only["B"] < 0.85 * default["B"]
    megatron = read_run(FIXTURES / "megatron_lm_1gpu").config  # Megatron-LM's code keeps its own context
    assert host_ranges(megatron, (1.0, 1.0)) == host_ranges(megatron, None)


def test_memory_outside_pytorch_on_an_h100_is_judged_from_its_own_calibration():
    row = only(reconcile_recorded(RUNS / "h1_llama1b_s4096"), "memory.outside_pytorch")
    assert row.verdict == "ok" and "NVIDIA H100 80GB HBM3" in row.explanation


@pytest.mark.parametrize("run", ["/nonexistent", "megatron_lm_1gpu", "h200_2layer_profiled"])
def test_host_contexts_refuses_a_run_it_cannot_fit_on_in_one_line(run, capsys):
    # no run; Megatron-LM's code (the contexts are this engine's recipes'); a run of another GPU
    path = run if run.startswith("/") else str(FIXTURES / run)
    assert_refused(bench_script("host_contexts"), ["--gpu", "H100", "--run", path], capsys)


SECOND = FIXTURES / "h100_second_shapes"  # predicted from the file's final form, committed before they ran


@pytest.mark.parametrize("name", ["cv_hd128_l4_s8192", "pw_llama1b_s1024_mbs8", "mid_llama1b_l8_s2048_mbs2",
                                  "lb_h768_l6_s512_mbs8"])
def test_four_of_the_six_shapes_predicted_before_they_ran_land_within_the_goal(name):
    assert abs(validate_run(SECOND / name).errors()["step_time"]) < 0.05


@pytest.mark.parametrize("name", ["mid_h1536_l12_s1024_mbs2", "ss_h768_l6_s1024_mbs2_graphed"])
def test_the_two_misses_are_short_where_their_host_ran_slower_than_the_file_prices_it(name):
    # hidden 1536: its host took 21.2 / 23.1 ms a forward / backward against 18.1 / 19.1 priced, its pace moving
    # within the window (360-431 ms steps); graphed hidden 768: its backward 3.9 ms on the device against 3.2
    assert -0.21 < validate_run(SECOND / name).errors()["step_time"] < -0.18


@pytest.mark.parametrize("name", sorted(p.name for p in SECOND.iterdir() if p.is_dir()))
def test_every_peak_of_the_second_set_is_predicted_within_a_tenth_of_a_percent(name):
    assert abs(validate_run(SECOND / name).errors()["peak_bytes"]) < 0.001


@pytest.mark.parametrize("argv", [
    ["--traces", "/nonexistent"],  # no run
    ["--traces", str(RUNS / "h1_llama1b_s4096")],  # a run without a profiler trace
    ["--sweep", "/nonexistent"],
    ["--sweep", str(CALIBRATION / "manifest.json")],  # not host sweep records
    ["--traces", str(CALIBRATION), "--graphs", str(FIXTURES / "megatron_lm_1gpu")],  # no graph primitives timed
])
def test_host_block_refuses_what_cannot_give_a_block_in_one_line(argv, capsys):
    assert_refused(bench_script("host_block"), ["--gpu", "H100", *argv], capsys)
