"""The time model prices MoE layers (ledger/models/time_model/ops.py): router, top-k, permute, each local expert's
SwiGLU MLP at its row count under uniform routing (or, under --moe-grouped-gemm, one grouped GEMM per linear over
all the rows), unpermute, and the expert-parallel all-to-alls on the compute stream; the compute sweep
(probes/compute_sweep/) times those catalogue entries (common/ops/moe.py) through the engine's own router,
dispatcher and grouped GEMM; reconcile replays an MoE run's step.

The hand-derived layer time is plumbing on a synthetic calibration (every GEMM 1 ns a FLOP, every memory-bound kernel
1 us, an all-to-all fit of 10 us + 1 ns a bus byte): it checks which ops are priced at which shapes and how they add
up, not any machine. The run test trains the tiny MoE model on CPU (gloo, one process) and reconciles it: it checks
that the replay runs on a real MoE run directory and fills the time rows, not how close they are (CPU timings on a
shared host are not a claim).
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from common.arguments import parse_args
from common.config import RunConfig
from common.ops import ExpertShapes, Shapes
from engine import probe_adapters
from engine.tensor_parallel.mappings import TPGroup
from engine.transformer.moe.expert_parallel import EPGroup
from engine.transformer.moe.moe_layer import MoEContext, MoELayer
from ledger.models.formulas.params import params_total
from ledger.models.time_model import Calibration, CommModel, LinkFit, ops, predict_step
from ledger.models.time_model.compute import price
from probes import compute_sweep
from probes.bandwidth import to_dtype
from probes.compute_sweep import EngineKernels, SweepSpec
from tests.support.recorded_runs import reconcile_recorded

NS = 1e-9
MEMORY_S, ALPHA, BETA = 1e-6, 10e-6, 1e-9
CPU = torch.device("cpu")
PREFIX = "decoder.layers.0."


def cfg(*flags: str) -> RunConfig:
    return parse_args(["--model", "tiny", "--num-experts", "4", "--moe-router-topk", "2", *flags])


def synthetic(c: RunConfig) -> Calibration:
    """Plumbing: a GEMM costs 1 ns per FLOP, any other kernel 1 us; all_to_all on ep 10 us + 1 ns a bus byte."""
    kernels = {(k.name, k.dims, c.train.params_dtype): k.flops * NS if k.flops else MEMORY_S
               for k in ops.kernels(c, 0)}
    return Calibration(kernels=kernels, rates={}, comm=CommModel({("ep", "all_to_all"): LinkFit(ALPHA, BETA, (1,))}))


def test_uniform_routing_sets_each_local_experts_rows():
    # T = 32 tokens x top-2 = 64 assignments; 4 experts on one rank: 16 rows each; EP 2: a rank's 2 experts receive
    # its 64 rows' worth (every rank routes alike): 32 each
    assert ExpertShapes.of(cfg()).rows == (16,) * 4
    assert ExpertShapes.of(cfg("--expert-model-parallel-size", "2", "--world-size", "2")).rows == (32, 32)
    # capacity factor 0.5: each expert keeps ceil(64 / 4 x 0.5) = 8 of them, 32 rows in all
    capped = ExpertShapes.of(cfg("--moe-expert-capacity-factor", "0.5"))
    assert (capped.routed, capped.rows) == (32, (8,) * 4)
    # 20 tokens x top-3 over 8 experts: 60 rows, as even as they go: 4 experts of 8, 4 of 7
    odd = ExpertShapes.of(cfg("--num-experts", "8", "--moe-router-topk", "3", "--seq-length", "20"))
    assert sorted(odd.rows) == [7] * 4 + [8] * 4
    assert ExpertShapes.of(parse_args(["--model", "tiny"])) is None


def test_an_moe_layer_costs_its_router_experts_copies_and_all_to_alls_by_hand():
    c = cfg("--expert-model-parallel-size", "2", "--world-size", "2")  # fp32, T 32, h 64, f_moe 176, 2 experts here
    sh, cal = Shapes.of(c), synthetic(c)
    router = 2 * 32 * 4 * 64  # [32, 64] x [64, 4]
    fc1, fc2 = 2 * 32 * 352 * 64, 2 * 32 * 64 * 176  # an expert's 32 rows: gate and up (2 x 176) then down
    rows_bytes = 64 * 64 * 4  # the rank's 64 routed rows of h fp32, either way
    counts = ALPHA + BETA * 4 * 8 / 2  # E int64, all-to-all bus factor (n-1)/n = 1/2
    rows = ALPHA + BETA * rows_bytes / 2
    # router GEMM, 2 x (fc1, fc2); top-k, permute, 2 SwiGLUs, unpermute; counts, dispatch, combine
    forward = (router + 2 * (fc1 + fc2)) * NS + 5 * MEMORY_S + counts + 2 * rows
    # every GEMM twice (dgrad, wgrad); the same 5 memory-bound kernels' backwards; the rows' all-to-alls the other way
    backward = 2 * (router + 2 * (fc1 + fc2)) * NS + 5 * MEMORY_S + 2 * rows
    fwd = price(ops.moe_forward(sh, PREFIX), c, cal, forward=True)
    bwd = price(ops.moe_backward(sh, PREFIX), c, cal, forward=False)
    assert fwd.seconds == pytest.approx(forward) and bwd.seconds == pytest.approx(backward)
    assert fwd.ep_comm == pytest.approx(counts + 2 * rows) and fwd.comm == 0.0
    # the router's weight is first used by its GEMM; its gradient is final after its wgrad, the backward's last op
    assert fwd.marks[PREFIX + "mlp.router.weight"] == 0.0 and bwd.marks[PREFIX + "mlp.router.weight"] == pytest.approx(
        backward)


@pytest.mark.parametrize("capacity, kept", [("", 64), ("--moe-expert-capacity-factor 0.5", 32)])
def test_grouped_gemms_price_one_kernel_per_linear_over_every_assignment_at_ep1(capacity, kept):
    """--moe-grouped-gemm at EP 1: fc1 and fc2 each one grouped GEMM (fprop; dgrad in backward) over all T k = 64
    assignments (the counts stay on the device, so the dropped rows under a capacity are carried too), one SwiGLU
    over them; each expert's wgrad a dense one over its kept rows (16 each, or the capacity's 8), which makes that
    expert's weight final."""
    c = cfg(*f"--moe-grouped-gemm {capacity}".split())
    sh, cal = ops.Shapes.of(c), synthetic(c)
    x = sh.moe
    assert x.grouped and x.grouped_rows == 64 and x.local_experts == 4 and x.routed == kept
    router, fc1, fc2 = 2 * 32 * 4 * 64, 2 * 64 * 352 * 64, 2 * 64 * 64 * 176
    wgrads = 2 * kept * 352 * 64 + 2 * kept * 64 * 176
    forward = price(ops.moe_forward(sh, PREFIX), c, cal, forward=True)
    backward = price(ops.moe_backward(sh, PREFIX), c, cal, forward=False)
    # the memory-bound kernels: top-k, permute, the one SwiGLU, unpermute
    assert forward.seconds == pytest.approx((router + fc1 + fc2) * NS + 4 * MEMORY_S)
    assert backward.seconds == pytest.approx((2 * router + fc1 + fc2 + wgrads) * NS + 4 * MEMORY_S)
    names = [w.op.name for w in ops.moe_forward(sh, PREFIX) if isinstance(w.op, ops.Kernel)]
    assert names.count("swiglu.fwd") == 1 and "experts.linear_fc1.fprop" in names and "linear_fc1.fprop" not in names
    wgrad = [w for w in ops.moe_backward(sh, PREFIX) if getattr(w.op, "name", "") == "linear_fc1.wgrad"]
    assert [w.params for w in wgrad] == [(f"{PREFIX}mlp.experts.{e}.linear_fc1.weight",) for e in range(4)]
    assert {dict(w.op.dims)["k"] for w in wgrad} == {kept // 4}


def test_grouped_gemms_under_ep2_run_over_the_kept_rows_received():
    c = cfg("--moe-grouped-gemm", "--moe-expert-capacity-factor", "0.5", "--expert-model-parallel-size", "2",
            "--world-size", "2")
    x = ops.Shapes.of(c).moe
    assert (x.grouped_rows, x.local_experts) == (x.routed, 2) and x.routed == 32  # 4 experts x capacity 8


def test_the_replay_prices_an_moe_step_with_the_all_to_alls_exposed():
    c = cfg("--expert-model-parallel-size", "2", "--world-size", "2")
    fits = {**synthetic(c).comm.fits, ("dp", "all_reduce"): LinkFit(ALPHA, BETA, (1,))}  # dense grads over dp 2
    cal = dataclasses.replace(synthetic(c), comm=CommModel(fits),
                              rates={("optimizer.step", "fp32"): NS, ("grad_buffer.zero", "fp32"): NS})
    step = predict_step(c, cal)
    rows = ALPHA + BETA * 64 * 64 * 4 / 2
    # 4 layers x (counts + dispatch + combine forward, combine + dispatch backward), one micro-batch
    assert step.stages[0].exposed["ep"] == pytest.approx(4 * (ALPHA + BETA * 16 + 4 * rows))


def engine_kernels(c: RunConfig) -> EngineKernels:
    """As engine/probe_adapters.py hands them to the sweep, its MoE handles from an MoE layer built here (EP 1,
    eager)."""
    layer = MoELayer(c.model, 0, moe=MoEContext(ep=EPGroup(group=None, size=1, rank=0)),
                     tp=TPGroup(group=None, size=1, rank=0), params_dtype=to_dtype(c.train.params_dtype),
                     device="cpu", seed=1)
    return probe_adapters.engine_kernels([layer], c.model.vocab_size, CPU)


def spec(c: RunConfig) -> SweepSpec:
    numel = params_total(c)
    return SweepSpec.from_run(c, first_stage=True, last_stage=True, optimizer_numel=numel, grad_buffer_numel=numel)


@pytest.mark.parametrize("flags", [(), ("--moe-aux-loss-coeff", "0.01", "--moe-expert-capacity-factor", "0.7",
                                        "--bf16"),
                                   ("--num-experts", "8", "--moe-router-topk", "3", "--seq-length", "20",
                                    "--expert-model-parallel-size", "2", "--world-size", "2"),
                                   ("--moe-grouped-gemm", "--moe-expert-capacity-factor", "0.7", "--bf16"),
                                   ("--moe-grouped-gemm", "--expert-model-parallel-size", "2", "--world-size", "2")],
                         ids=["plain", "aux-loss-capacity-bf16", "uneven-rows-ep2", "grouped-capacity-bf16",
                              "grouped-ep2"])
def test_the_sweep_times_the_moe_ops_through_the_engines_functions(flags, tmp_path, monkeypatch):
    """Every catalogue entry of the MoE layer is timed (router, top-k, permute, unpermute, each expert row count's
    MLP or the grouped GEMMs), through the engine's router, dispatcher and grouped GEMM."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    c = cfg(*flags)
    records = compute_sweep.run(spec(c), CPU, engine_kernels(c), warmup=0, iters=1)
    timed = {(r["op"], tuple(sorted(r["dims"].items()))) for r in records if r["seconds"] > 0}
    assert timed >= {(k.name, k.dims) for k in spec(c).ops.kernels()}
    assert {"router.fprop", "router.topk.fwd", "router.topk.bwd", "moe.permute.fwd", "moe.permute.bwd",
            "moe.unpermute.fwd", "moe.unpermute.bwd"} <= {op for op, _ in timed}


def test_a_dense_models_sweep_has_no_moe_ops_and_needs_no_moe_handles():
    dense = parse_args(["--model", "tiny"])
    planned = compute_sweep.plan(spec(dense), CPU, dataclasses.replace(engine_kernels(cfg()), moe=None))
    assert not {p.op for p in planned} & {"router.fprop", "moe.permute.fwd"}


def test_grouped_gemms_are_timed_through_the_engines_and_need_them(tmp_path, monkeypatch):
    """Under --moe-grouped-gemm the experts' GEMMs are the grouped kernels (keyed by the local expert count), timed
    through MoEKernels.grouped_linear (each expert's wgrad a dense one, at its rows); SequentialMLP's handles have
    none, and the sweep refuses to time them."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    c = cfg("--moe-grouped-gemm")
    records = compute_sweep.run(spec(c), CPU, engine_kernels(c), warmup=0, iters=1)
    timed = {r["op"]: r["dims"] for r in records if r["seconds"] > 0}
    assert {f"experts.{linear}.{gemm}" for linear in ("linear_fc1", "linear_fc2")
            for gemm in ("fprop", "dgrad")} | {"linear_fc1.wgrad", "linear_fc2.wgrad"} <= set(timed)
    assert timed["experts.linear_fc1.fprop"]["experts"] == 4
    assert not {"linear_fc1.fprop", "linear_fc2.fprop"} & set(timed)  # no per-expert GEMM beside them
    sequential = engine_kernels(cfg())
    with pytest.raises(ValueError, match="grouped_linear"):
        compute_sweep.plan(spec(c), CPU, sequential)


def test_an_moe_sweep_without_the_engines_moe_handles_is_refused():
    with pytest.raises(ValueError, match="EngineKernels.moe"):
        compute_sweep.plan(spec(cfg()), CPU, dataclasses.replace(engine_kernels(cfg()), moe=None))


@pytest.mark.slow
def test_reconcile_replays_an_moe_runs_step_from_its_sweep(ep2_run):
    result = reconcile_recorded(ep2_run)
    predicted = {r.metric: r.predicted for r in result.rows if r.metric in (
        "throughput.step_time", "time.forward_per_microbatch", "time.backward_per_microbatch", "time.optimizer_step")}
    assert len(predicted) == 4 and all(p is not None and p > 0 for p in predicted.values())
    assert not any("time model" in line for line in result.missing)
