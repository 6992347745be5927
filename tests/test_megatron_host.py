"""Megatron-LM's host (ledger/models/time_model/megatron_host_recipe.py): every catalogue entry of a run of its local
layers has a recipe, the recipes launch what Megatron launched, the one factor for its Python is the one its
calibration run fits, and the step time of the runs it did not see comes within 10% from the H200 file. A layout the
recipes do not describe (Transformer Engine layers) runs on the device's clock alone and says so. Configs and traces
are real: megatron_lm_1gpu (hidden 256: every GEMM one kernel; the calibration run) and the two H200 fixtures."""
from __future__ import annotations

import gzip
import json
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from common.ops import host as p
from ledger.evidence.read import read_run
from ledger.models.simulate.hardware import load_hardware
from ledger.models.simulate.simulation import simulate
from ledger.models.time_model import host_recipe as recipe
from ledger.models.time_model import megatron_host_recipe as megatron
from ledger.models.time_model.ops import Collective, chunk_backward, chunk_forward
from ledger.reconcile.time_rows import TimeSources, predict_run
from tests.support.bench import assert_refused
from tests.support.recorded_runs import FIXTURES, reconcile_recorded

ROOT = Path(__file__).resolve().parents[1]
MEGATRON_RUN = FIXTURES / "megatron_lm_1gpu"
H200_RUNS = [FIXTURES / "megatron_lm_h200" / name for name in ("local_l2_mbs2", "sdpa_l4_mbs2")]
# What each primitive launches on an H200 at the calibration run's widths (one kernel a GEMM; cuDNN's SDPA: two)
LAUNCHES = {p.LAUNCH: 1, p.EAGER: 1, p.GEMM: 1, p.COMPILED: 1, p.EAGER_BACKWARD: 1, p.COMPILED_BACKWARD: 1,
            p.ATTENTION: 2, p.ATTENTION_BACKWARD: 6}


LAUNCH_CALLS = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx", "cudaMemsetAsync", "cudaMemcpyAsync")


def launched(counts) -> int:
    return sum(n * LAUNCHES.get(k, 0) for k, n in counts.items())


@pytest.mark.parametrize("run", [MEGATRON_RUN, *H200_RUNS], ids=lambda r: r.name)
def test_every_entry_of_megatrons_local_layers_has_a_recipe(run):
    cfg = read_run(run).config
    assert recipe.unmodelled_host(cfg) is None
    for forward, works in ((True, chunk_forward(cfg, 0, 0)), (False, chunk_backward(cfg, 0, 0))):
        for w in works:
            assert isinstance(w.op, Collective) or megatron.entry(w, forward) is not None
    engine_only = replace(cfg, implementation=replace(cfg.implementation, transformer_impl="transformer_engine"))
    assert "not --transformer-impl transformer_engine" in recipe.unmodelled_host(engine_only)


def traced_launches(run: Path, micro_batch: int) -> dict[str, int]:
    """A profiled step's micro-batch in Megatron-LM's trace: the launches on the main thread from its batch's fetch
    to torch.autograd.backward's seed (the forward), and on the autograd thread after it (the backward)."""
    events = json.load(gzip.open(next((run / "torch_profile").glob("*.json.gz"))))["traceEvents"]
    (step,) = [e for e in events if e.get("name") == "ProfilerStep#6" and e.get("cat") == "user_annotation"]
    inside = sorted((e for e in events if step["ts"] <= e.get("ts", -1) < step["ts"] + step["dur"]),
                    key=lambda e: e["ts"])
    fetches = [e["ts"] for e in inside if e["name"].startswith("enumerate(DataLoader)")] + [step["ts"] + step["dur"]]
    seeds = [e["ts"] for e in inside if e["name"] == "aten::ones_like" and e["tid"] == step["tid"]]
    calls = [e for e in inside if e["name"] in LAUNCH_CALLS]
    start, seed, end = fetches[micro_batch], seeds[micro_batch], fetches[micro_batch + 1]
    return {"forward": sum(1 for e in calls if start <= e["ts"] < seed and e["tid"] == step["tid"]),
            "backward": sum(1 for e in calls if seed <= e["ts"] < end and e["tid"] != step["tid"])}


def test_the_recipes_launch_what_megatron_launched_in_a_real_micro_batch():
    """megatron_lm_1gpu, whose GEMMs are one kernel each: the forward (the batch, two layers, the loss and its
    checks) and the backward of a micro-batch launched 133 and 135 kernels, copies and memsets; the recipes imply
    within 2% of each."""
    cfg = read_run(MEGATRON_RUN).config
    forward = sum(launched(megatron.entry(w, True)) for w in chunk_forward(cfg, 0, 0)) \
        + launched(megatron.forward_start(True)) + launched(megatron.LOSS) \
        + sum(map(launched, megatron.LOSS_CHECKS)) + launched(megatron.LOSS_SCALE)
    backward = sum(launched(megatron.entry(w, False)) for w in chunk_backward(cfg, 0, 0)) \
        + launched(megatron.BACKWARD_START)
    assert traced_launches(MEGATRON_RUN, 1) == {"forward": 133, "backward": 135}
    assert abs(forward - 133) <= 0.02 * 133 and abs(backward - 135) <= 0.02 * 135


def test_megatrons_context_is_what_its_calibration_run_fits():
    """runs/bench/host_model.py --calibrate megatron_lm_1gpu: the factor for Megatron's Python that brings that
    host-bound run's predicted step to its measured 89.8 ms is megatron_host_recipe.CONTEXT (within 1%)."""
    sys.path.insert(0, str(ROOT / "runs" / "bench"))
    import host_model
    run = host_model.load(MEGATRON_RUN)
    assert run.step == pytest.approx(0.08983, rel=1e-3)
    assert host_model.fit([run], "H200") == pytest.approx(megatron.CONTEXT, rel=0.01)


@pytest.mark.parametrize("run", H200_RUNS, ids=lambda r: r.name)
def test_an_h200_run_it_did_not_see_comes_within_ten_percent_and_not_without_its_host(run):
    """The H200 fixtures (hidden 2048, seq 4096; --timing-log-level 2) from the H200 file alone: step time within
    10% of the measured for both, the local run 5-8% short (12-15% before its unfused attention's batched GEMMs were
    priced at their operands' streaming and its 16-bit masked softmax at its own efficiency). Without the host
    timeline (the device's clock alone) the local run misses by more than 10%: the host is what closes the rest."""
    sources = TimeSources(hardware=load_hardware("H200"))
    (step,) = [r for r in reconcile_recorded(run, sources=sources).rows if r.metric == "throughput.step_time"]
    low, high = (0.05, 0.08) if run.name == "local_l2_mbs2" else (-0.10, 0.10)
    assert low < step.rel_diff < high
    ev = read_run(run)
    model = predict_run(ev, sources)
    assert model.step.step_time == pytest.approx(step.predicted)
    device_only = simulate(replace(ev.config, implementation=replace(ev.config.implementation,
                                                                     transformer_impl="transformer_engine")),
                           load_hardware("H200")).step
    if run.name == "local_l2_mbs2":
        assert abs(device_only.step_time / step.measured - 1) > 0.10


def test_megatrons_synchronising_timers_cost_the_step_time():
    """--timing-log-level 2 (the H200 fixtures): the forward-compute and backward-compute timers call
    torch.cuda.synchronize() as they start and stop, so each pass starts on an idle device after the host's work
    before its first kernel; the same config without them is predicted shorter."""
    cfg = read_run(H200_RUNS[0]).config
    assert cfg.implementation.timers_synchronise_passes
    untimed = replace(cfg, implementation=replace(cfg.implementation, timers_synchronise_passes=False))
    hw = load_hardware("H200")
    assert simulate(untimed, hw).step.step_time < simulate(cfg, hw).step.step_time


def test_reconciling_megatron_runs_predicts_every_term_of_the_decomposition():
    """With the host timeline the twin is whole: every term of every profiled step has a prediction from the config
    and the H200 file (a device-only twin leaves the host's terms unpredicted)."""
    for run in (MEGATRON_RUN, *H200_RUNS):
        result = reconcile_recorded(run, sources=TimeSources(hardware=load_hardware("H200")))
        terms = [r for r in result.rows if r.metric.startswith("step.decomposition.")]
        assert len(terms) == 3 * 7 and all(r.predicted is not None for r in terms)  # 3 steps, 7 terms


def test_megatrons_window_steps_share_one_twin_as_its_profiler_starts_before_them():
    # Megatron-LM's profiler schedule starts tracing in a warm-up step before its window: the first recorded step
    # opens like the others, so its twin has no profiler start added (this engine's windows do: test_host_model.py).
    result = reconcile_recorded(MEGATRON_RUN, sources=TimeSources(hardware=load_hardware("H200")))
    twins = {r.predicted for r in result.rows if r.metric == "step.decomposition.host_bound_idle"}
    assert len(twins) == 1


def test_a_device_only_twin_judges_device_compute_and_leaves_the_other_terms_unpredicted():
    """Plumbing (hand-made partition): the twin of a GPU run without a host timeline names device compute alone. A
    prediction 3.5x off the measured device compute is "off", one at it is "ok"; the host's terms, which it does not
    name, get no prediction (not zero: a complete twin's zero would judge them)."""
    from ledger.evidence.step_partition import COMPUTE, HOST_BOUND, StepPartition
    from ledger.reconcile.step_decomposition import term_rows

    part = StepPartition(rank=0, step=5, start=0.0, end=400e3, terms=[(COMPUTE, 300e3), (HOST_BOUND, 100e3)])
    for predicted, verdict in ((0.300, "ok"), (3.5 * 0.300, "off")):
        device, host = term_rows(0, part, {COMPUTE: predicted}, "device only", complete=False)
        assert (device.verdict, device.predicted) == (verdict, predicted)
        assert host.predicted is None and host.verdict == "n/a"
    _, host = term_rows(0, part, {COMPUTE: 0.300}, "complete")
    assert host.predicted == 0.0 and host.verdict == "off"


# ---- the H100's own Megatron-LM context (h100.json host.megatron_context) -----------------------------------------

H100_RUNS = FIXTURES / "megatron_lm_h100"
H100_HELD_OUT = ("sdpa_l4_mbs2", "local_l2_mbs1", "local_l2_mbs2")


def h100_step(name: str, megatron_context: float | None = None) -> tuple[float, float]:
    """(predicted, measured) step of an H100 Megatron-LM fixture reconciled with the H100 file, its host block's
    Megatron-LM context replaced where given."""
    hw = load_hardware("H100")
    if megatron_context is not None:
        hw = replace(hw, host=replace(hw.host, megatron_context=megatron_context))
    (step,) = [r for r in reconcile_recorded(H100_RUNS / name, sources=TimeSources(hardware=hw)).rows
               if r.metric == "throughput.step_time"]
    return step.predicted, step.measured


def test_the_h100s_megatron_context_is_what_its_calibration_run_fits():
    """The H100 file's host block was estimated from this engine's calibration trace, its calls' prices holding
    Python the H200's block leaves to CONTEXT: Megatron-LM's factor on it is its own, fitted by runs/bench/
    host_model.py --calibrate sdpa_l4_mbs1 --hardware H100 --write (the most host-bound of the four H100 runs,
    367 ms a step) and stored in the file, 0.855 against the code's 2.55 fitted on the H200's block."""
    sys.path.insert(0, str(ROOT / "runs" / "bench"))
    import host_model
    stored = load_hardware("H100").host.megatron_context
    assert stored == pytest.approx(host_model.fit([host_model.load(H100_RUNS / "sdpa_l4_mbs1")], "H100"), rel=0.01)
    assert load_hardware("H200").host.megatron_context is None  # the H200 keeps megatron_host_recipe.CONTEXT
    assert stored < 0.4 * megatron.CONTEXT


@pytest.mark.parametrize("name", H100_HELD_OUT)
def test_h100_runs_the_context_did_not_see_come_within_five_percent_and_not_at_the_h200s(name):
    """The three other H100 runs of Megatron-LM's cases (the H200 fixtures' flags, recorded in the same call) from
    the H100 file: -2.9..-3.5% with the H100's Megatron-LM context. At the code's CONTEXT, the H200 block's, the
    predictions committed before the runs (f65e8ff) were +2.4% and +5.6% (local) and +16.9% (SDPA, its host
    twice over-priced): the SDPA run misses by more than 10% there."""
    predicted, measured = h100_step(name)
    assert -0.05 < predicted / measured - 1 < 0
    at_h200s, _ = h100_step(name, megatron.CONTEXT)
    assert at_h200s > predicted
    if name.startswith("sdpa"):
        assert at_h200s / measured - 1 > 0.10


def test_host_model_writes_only_a_megatron_fit_into_a_named_gpus_file(capsys):
    sys.path.insert(0, str(ROOT / "runs" / "bench"))
    import host_model
    assert_refused(host_model, ["--calibrate", str(FIXTURES / "h200_2layer_profiled"), "--hardware", "H200", "--write"],
                   capsys)
    assert_refused(host_model, ["--calibrate", str(H100_RUNS / "sdpa_l4_mbs1"), "--hardware", "nowhere.json",
                            "--write"], capsys)


@pytest.mark.parametrize("argv", [
    ["--calibrate", "/nonexistent/run"],
    ["--calibrate", str(MEGATRON_RUN), "--hardware", "H999"],
    ["--calibrate", str(MEGATRON_RUN), "--validate", str(MEGATRON_RUN)],
    ["--calibrate", str(MEGATRON_RUN), "--validate", str(FIXTURES / "h200_2layer_profiled")],
], ids=["no run", "unknown hardware", "a run twice", "two codes"])
def test_host_model_refuses_bad_input_in_one_line(argv, capsys):
    sys.path.insert(0, str(ROOT / "runs" / "bench"))
    import host_model
    assert_refused(host_model, argv, capsys)


def test_reconcile_prices_the_host_with_the_named_hardware_files_block():
    """`reconcile --hardware`: the host block of the file named prices the host of a run without its own host sweep,
    not that of the file its trace's GPU names (which once won, so a changed block was silently ignored)."""
    assert h100_step("sdpa_l4_mbs2", megatron.CONTEXT)[0] > 1.1 * h100_step("sdpa_l4_mbs2")[0]
