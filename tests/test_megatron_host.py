"""The host timeline's recipes are this engine's calls (ledger/models/time_model/host_recipe.py): every catalogue entry
of an engine configuration has one, and a configuration of Megatron-LM's own layers is predicted on the device's clock
alone, saying so, whether its prices come from a hardware file with a host block (simulate, reconcile --hardware) or
not. Configs are real: the recorded engine run lb_h1024_l4_s512 and the recorded Megatron-LM run megatron_lm_1gpu
(--transformer-impl local, unfused attention, RoPE and SwiGLU; its trace names the H200)."""
from __future__ import annotations

from ledger.evidence.read import read_run
from ledger.models.simulate.hardware import load_hardware
from ledger.models.simulate.simulation import simulate
from ledger.models.time_model import host_recipe as recipe
from ledger.models.time_model.ops import Collective, chunk_backward, chunk_forward
from ledger.reconcile.rows import WARN_FACTOR
from ledger.reconcile.run import reconcile
from ledger.reconcile.time_rows import TimeSources, predict_run
from tests.support.recorded_runs import FIXTURES

ENGINE_RUN = FIXTURES / "h200_launch_bound" / "lb_h1024_l4_s512"
MEGATRON_RUN = FIXTURES / "megatron_lm_1gpu"
# Megatron-LM's unfused chains the run's local layers compute (common/ops/megatron.py): no recipe prices their host
MEGATRON_ONLY = {f"{chain}.{pass_}" for chain in ("attention.repeat_kv", "core_attention.softmax", "cross_entropy_fp32",
                                                  "rope_unfused", "swiglu_unfused") for pass_ in ("fwd", "bwd")}
MEGATRON_ONLY.add("main_grad.add")


def without_recipe(cfg) -> set[str]:
    """The names of a one-stage config's entries (forward and backward) that host_recipe.entry cannot price."""
    missing = set()
    for forward, works in ((True, chunk_forward(cfg, 0, 0)), (False, chunk_backward(cfg, 0, 0))):
        for w in works:
            if isinstance(w.op, Collective):
                continue
            try:
                recipe.entry(w, forward)
            except KeyError:
                missing.add(w.op.name)
    return missing


def test_every_entry_of_the_engine_has_a_recipe_and_megatrons_own_chains_have_none():
    engine, megatron = read_run(ENGINE_RUN).config, read_run(MEGATRON_RUN).config
    assert without_recipe(engine) == set() and recipe.unmodelled_host(engine) is None
    assert without_recipe(megatron) == MEGATRON_ONLY
    assert "--transformer-impl local" in recipe.unmodelled_host(megatron)


def test_simulating_megatrons_layers_on_a_gpu_with_a_host_block_runs_on_the_devices_clock():
    hw = load_hardware("H200")
    assert hw.host is not None
    engine = simulate(read_run(ENGINE_RUN).config, hw).step
    megatron = simulate(read_run(MEGATRON_RUN).config, hw).step
    assert engine.decompositions and not any("host recipes" in n for n in engine.notes)
    assert megatron.decompositions == {} and megatron.step_time > 0
    assert any(n.startswith("host timeline off: the host recipes are this engine's calls") for n in megatron.notes)


def test_reconciling_a_megatron_run_with_the_h200_file_says_its_host_is_not_modelled():
    """The run's trace names the H200, whose file has a host block: the host is still not priced, and said so; the
    decomposition's device compute, which needs no host clock, is judged against the time model's device work (its
    passes' kernels, the memset, the update: from the config and the hardware file, never the trace) and the host's
    terms stay unpredicted."""
    ev = read_run(MEGATRON_RUN)
    model = predict_run(ev, TimeSources(hardware=load_hardware("H200")))
    assert model.calibration.host is None and "host recipes" in model.calibration.host_note
    assert model.step is not None and model.step.decompositions == {}
    result = reconcile(MEGATRON_RUN, sources=TimeSources(hardware=load_hardware("H200")))
    (step,) = [r for r in result.rows if r.metric == "throughput.step_time"]
    assert step.predicted is not None and "host recipes are this engine's calls" in step.explanation
    terms = [r for r in result.rows if r.metric.startswith("step.decomposition.")]
    device = [r for r in terms if r.metric == "step.decomposition.device_compute"]
    assert len(device) == 3  # the profiled steps 5-7
    for r in device:
        assert r.predicted == model.step.device_compute[0] and r.predicted != r.measured
        gap = abs(r.rel_diff)
        assert r.verdict == ("ok" if gap <= 0.10 else "warn" if gap <= WARN_FACTOR * 0.10 else "off")
    others = [r for r in terms if r not in device]
    assert others and all(r.predicted is None and "host recipes" in r.explanation for r in others)


def test_megatrons_synchronising_timers_are_named_where_the_run_has_them():
    """--timing-log-level 2 (the H200 fixtures): Megatron-LM's forward-compute and backward-compute timers call
    torch.cuda.synchronize() in start() and stop(), so every pass starts on an idle device; the step time's
    explanation says so. The 1-GPU run logged its timers at the default level 0: no such words."""
    timed = read_run(FIXTURES / "megatron_lm_h200" / "local_l2_mbs2").config
    untimed = read_run(MEGATRON_RUN).config
    assert timed.implementation.timers_synchronise_passes and not untimed.implementation.timers_synchronise_passes
    assert recipe.SYNCHRONISING_TIMERS in recipe.unmodelled_host(timed)
    assert recipe.SYNCHRONISING_TIMERS not in recipe.unmodelled_host(untimed)
    (step,) = [r for r in reconcile(FIXTURES / "megatron_lm_h200" / "local_l2_mbs2",
                                    sources=TimeSources(hardware=load_hardware("H200"))).rows
               if r.metric == "throughput.step_time"]
    assert "timers synchronise the device at every forward's and backward's start and end" in step.explanation


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
