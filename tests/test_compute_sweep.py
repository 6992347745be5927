"""probes/compute_sweep/: the start-up sweep times exactly the catalogue's entries for the rank's stage (common/ops,
which the time model prices too), through the engine's own functions, writes records the calibration reads, and
caches them per machine and shape.

CPU, tiny shapes: these test plumbing (which ops, which fields, which cache entry), not timings.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from common.arguments import parse_args
from common.config import RunConfig
from common.ops import RATE_OPS
from engine.tensor_parallel import layers
from ledger.models.formulas.params import params_total
from ledger.models.time_model import Calibration, predict_step, stage_time
from probes import compute_sweep
from tests.support.bench import assert_refused, bench_script
from tests.support.recorded_runs import FIXTURES
from tests.support.records import typed
from tests.support.sweep_inputs import kernels, spec

CPU = torch.device("cpu")
# What a record carries (the package's docstring; the calibration reads op, dims, dtype, seconds).
FIELDS = {"op", "dims", "dtype", "seconds", "flops", "iters", "device", "threads", "variant", "cached"}


PIPELINED = ("--model tiny --num-layers 6 --world-size 6 --tensor-model-parallel-size 2 --sequence-parallel "
             "--pipeline-model-parallel-size 3 --global-batch-size 6 --bf16 --recompute-granularity selective")
SINGLE = "--model tiny --num-layers 2 --seq-length 16 --global-batch-size 2 --bf16"
# The GPT style (simulate's semantics: formulas only, the engine runs none), TP2 with SP: gelu, layer_norm, no rope.
GPT = ("--num-layers 4 --hidden-size 256 --num-attention-heads 8 --vocab-size 1000 --seq-length 64 --bf16 "
       "--world-size 2 --tensor-model-parallel-size 2 --sequence-parallel --global-batch-size 2")
CASES = {"first": (PIPELINED, 0), "middle": (PIPELINED, 1), "last": (PIPELINED, 2), "single": (SINGLE, 0),
         "single-untied-fp32": (SINGLE.replace("--bf16", "--untie-embeddings-and-output-weights"), 0),
         # DDP's hook adds each 16-bit wgrad: main_grad.add at each weight size (qkv, proj, fc1, fc2, output layer)
         "single-unfused": (SINGLE + " --no-gradient-accumulation-fusion", 0),
         "cp2": (SINGLE + " --context-parallel-size 2 --world-size 2", 0), "gpt-tp2-sp": (GPT, 0),
         "last-fused-loss": (PIPELINED + " --cross-entropy-loss-fusion --cross-entropy-fusion-impl linear", 2)}


@pytest.mark.parametrize("case", CASES)
def test_the_sweep_times_exactly_the_catalogues_entries(case, cache):
    """Each record is one catalogue entry, in the catalogue's order, at its dims (in the catalogue's declared order:
    what the committed records hold), dtype and FLOPs, timed; then the per-element work at its own dtype."""
    flags, stage = CASES[case]
    c = parse_args(flags.split(), megatron_model=case.startswith("gpt"))
    s = spec(c, stage)
    records = compute_sweep.run(s, CPU, kernels(c), warmup=0, iters=1)
    entries = [(k.name, list(k.record_dims().items()), c.train.params_dtype, k.flops) for k in s.ops.kernels()]
    numel = params_total(c)
    rates = [("optimizer.step", [("numel", numel)], c.train.params_dtype, 0.0),
             ("grad_buffer.zero", [("numel", numel)], c.train.grad_dtype, 0.0)]
    assert [(r["op"], list(r["dims"].items()), r["dtype"], r["flops"]) for r in records] == entries + rates
    assert all(r["seconds"] > 0 for r in records)
    adds = {r["dims"]["numel"] for r in records if r["op"] == "main_grad.add"}
    assert len(adds) == (5 if case == "single-unfused" else 0)


def test_a_linears_wgrad_is_timed_through_the_engines_weight_gradient_accumulation():
    """The sweep has no GEMM of its own for the wgrad: it calls EngineKernels.wgrad, the engine's
    accumulate_weight_grad, main_grad [out, inp] += dY^T X."""
    calls = []

    def spy(main_grad, grad_output, total_input):
        calls.append((tuple(main_grad.shape), main_grad.dtype, tuple(grad_output.shape), tuple(total_input.shape)))
        layers.accumulate_weight_grad(main_grad, grad_output, total_input)

    c = parse_args(SINGLE.split())
    planned = compute_sweep.plan(spec(c, 0), CPU, dataclasses.replace(kernels(c), wgrad=spy))
    (qkv,) = [p for p in planned if p.op == "linear_qkv.wgrad"]
    qkv.build().run()
    m, n, k = qkv.dims["m"], qkv.dims["n"], qkv.dims["k"]
    assert calls == [((m, n), torch.float32, (k, m), (k, n))]  # bf16 params, fp32 main grads


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "train-ledger" / "compute"


def sweep(c: RunConfig, use_cache: bool = True) -> list[dict]:
    return compute_sweep.run(spec(c, 0), CPU, kernels(c), use_cache=use_cache, warmup=1, iters=2)


def test_records_carry_the_documented_fields_and_calibrate_a_whole_step(cache):
    c = parse_args(SINGLE.split())
    records = sweep(c)
    assert all(set(r) == FIELDS for r in records)
    assert all(r["seconds"] > 0 and r["iters"] == 2 and r["variant"] == "eager" and not r["cached"] for r in records)
    assert {r["op"] for r in records} >= set(RATE_OPS)
    cal = Calibration.from_records(typed("compute", records), [])
    assert cal.sustained == 1.0  # the power-limit record is GPU only
    assert stage_time(c, cal, 0).forward > 0
    assert predict_step(c, cal).step_time > 0  # one rank: no link needed


def test_keep_times_only_the_ops_it_keeps():
    """A filtered grid (hardware_sweep.py --short-attention) times its own ops alone: every other op of the point is
    neither timed nor returned."""
    c = parse_args(SINGLE.split())
    every = {p.op for p in compute_sweep.plan(spec(c, 0), CPU, kernels(c))}
    kept = compute_sweep.run(spec(c, 0), CPU, kernels(c), use_cache=False, warmup=0, iters=1,
                             keep=lambda op: op.startswith("core_attention."))
    assert {r["op"] for r in kept} == {op for op in every if op.startswith("core_attention.")}
    assert len(kept) < len(every)


def test_a_megatron_grid_point_times_each_weights_main_grad_add():
    """hardware_sweep.py --megatron plans, beside Megatron-LM's unfused chains, DDP's add of each weight's 16-bit
    gradient into main_grad (no gradient-accumulation fusion, as Megatron-LM's local runs and the engine's
    --no-gradient-accumulation-fusion runs have it), one entry per weight size: llama3.2-1b's QKV (2048 x 3072),
    attention output (2048 x 2048), fc1 (2 x 8192 x 2048), fc2 (2048 x 8192) and the untied output layer
    (128,256 x 2048). Planned only: nothing is timed here."""
    sweep_script = bench_script("hardware_sweep")
    label, _, point = next(sweep_script.megatron_specs())
    assert label.startswith("llama3.2-1b tp1 s4096 mbs1 megatron")
    keep = sweep_script.kept_ops(sweep_script.argparse.Namespace(megatron=True, moe=False, experts=False,
                                                                 short_attention=False))
    planned = [p for p in compute_sweep.plan(point, CPU, sweep_script.engine_kernels([], 128256, CPU)) if keep(p.op)]
    adds = sorted(p.dims["numel"] for p in planned if p.op == "main_grad.add")
    assert adds == sorted([2048 * 3072, 2048 * 2048, 2 * 8192 * 2048, 2048 * 8192, 128256 * 2048])
    assert {"core_attention.softmax.fwd", "cross_entropy_fp32.bwd"} <= {p.op for p in planned}


def test_a_call_before_each_timed_one_runs_once_a_timing_and_leaves_the_cache_alone(cache):
    # runs/bench/l2_state.py evicts the L2 before each timed call: those records are an experiment's, not the sweep's,
    # so a later sweep of the same shapes must not read them back
    c = parse_args(SINGLE.split())
    calls = []
    records = compute_sweep.run(spec(c, 0), CPU, kernels(c), warmup=0, iters=2, before=lambda: calls.append(1))
    assert len(calls) == 2 * len(records) and not any(r["cached"] for r in records)
    assert not cache.exists() or not any(cache.iterdir())


def test_a_second_run_of_the_same_shapes_reads_the_cache_and_no_cache_measures_again(cache):
    c = parse_args(SINGLE.split())
    first = sweep(c)
    assert len(list(cache.glob("*.json"))) == 1
    again = sweep(c)
    assert all(r["cached"] for r in again)
    assert [(r["op"], r["seconds"]) for r in again] == [(r["op"], r["seconds"]) for r in first]
    fresh = sweep(c, use_cache=False)
    assert not any(r["cached"] for r in fresh)
    refreshed = sweep(c)  # --no-compute-sweep-cache measured anew and rewrote the entry
    assert all(r["cached"] for r in refreshed)
    assert [r["seconds"] for r in refreshed] == [r["seconds"] for r in fresh]


def test_other_shapes_are_measured_not_read_from_anothers_cache_entry(cache):
    sweep(parse_args(SINGLE.split()))
    longer = sweep(parse_args(SINGLE.replace("--seq-length 16", "--seq-length 32").split()))
    assert not any(r["cached"] for r in longer)
    assert len(list(cache.glob("*.json"))) == 2


def test_a_run_without_the_wgrad_fusion_is_measured_not_read_from_a_fused_runs_entry(cache):
    """--no-gradient-accumulation-fusion times each wgrad with its add into main_grad: another measurement
    (on an H200 a seq-8192 run without the fusion had read the fused run's entry: BENCHMARKS.md, 2026-12-03)."""
    c = parse_args(SINGLE.split())
    sweep(c)
    unfused = compute_sweep.run(spec(c, 0), CPU, dataclasses.replace(kernels(c), wgrad_fusion=False), warmup=1,
                                iters=2)
    assert not any(r["cached"] for r in unfused)
    assert len(list(cache.glob("*.json"))) == 2


def test_a_cache_that_cannot_be_written_costs_a_measurement_not_the_run(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # the cache folder would sit under a file
    records = sweep(parse_args(SINGLE.split()))
    assert records and not any(r["cached"] for r in records)


def test_the_l2_experiments_judge_refuses_bad_arguments_in_one_line_before_reading_any_run(tmp_path, capsys):
    # runs/bench/l2_state.py --judge: an unreadable output file, a run given without its shape's name or one that is
    # not a run directory, and --out into a folder that does not exist, each one line and exit 2 before any work
    script = bench_script("l2_state")
    results = Path(__file__).resolve().parents[1] / "runs/bench/results/2026-12-05_l2_state_h200.json.gz"
    run = FIXTURES / "h200_launch_bound" / "lb_h1024_l4_s512"
    for argv in (["--judge", str(tmp_path / "absent.json.gz"), f"{run}=lb_h1024_l4_s512"],
                 ["--judge", str(results), str(run)],
                 ["--judge", str(results), f"{tmp_path}=lb_h1024_l4_s512"],
                 ["--out", str(tmp_path / "no" / "such" / "out.json.gz")]):
        assert_refused(script, argv, capsys)
