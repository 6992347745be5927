"""The H200 hardware file's MoE routing passes (router top-k, moe.permute, moe.unpermute), fitted from a grid sweep of
those kernels alone (runs/bench/hardware_sweep.py --moe) and judged on two mixtral-8x7b-2l runs recorded in the same
device call, which the fit never reads (tests/fixtures/h200_moe/README.md, "routing_fit").

Before that sweep the file had no fit of them: each pass was priced at the median plain kernel's efficiency and the
shared 4 us fixed cost, 4-63 us where the engine's passes take 30-280 us (each is a chain of small kernels; the
permute also waits for the counts' read to the host). simulate then put the grouped run 6% under its measured step.
The top-k with the load-balancing loss is its own chain (`router.topk_aux`). Last, the experts' GEMMs on a grid of
their own (--experts, not in the GEMM fit): what the fit prices within the dense grid's spread, and where it stops.
"""
from __future__ import annotations

import dataclasses
import gzip
import json
from typing import Callable

import pytest

from common.ops import Kernel
from common.ops.moe import is_routing_kernel
from ledger.evidence.read import read_run
from ledger.models.simulate.fit import fit_routing_pass
from ledger.models.simulate.hardware import Hardware, load_hardware
from ledger.models.simulate.kernel_cost import kernel_seconds
from ledger.models.simulate.simulation import simulate
from ledger.reconcile.validation import validate_run
from tests.support.recorded_runs import FIXTURES

RUNS = FIXTURES / "h200_moe" / "routing_fit"
STEP_GOAL = 0.05  # simulate --validate's goal for a one-GPU run's step time (issue "Ledger IV")
KERNEL_BAR = 0.10  # each pass of the held-out run's own sweep against the file (the grid's own spread)


def without(hw: Hardware, dropped: Callable[[str], bool]) -> Hardware:
    """The file without the memory-bound entries (efficiency, own fixed cost) of the names `dropped` picks."""
    return dataclasses.replace(hw, memory=dataclasses.replace(
        hw.memory, kernels=tuple((n, e) for n, e in hw.memory.kernels if not dropped(n)),
        fixed_by_kernel=tuple((n, f) for n, f in hw.memory.fixed_by_kernel if not dropped(n))))


def without_routing_fit(hw: Hardware) -> Hardware:
    """The file as it was before the MoE sweep: no efficiency or fixed cost of the routing passes."""
    return without(hw, is_routing_kernel)


def routing_records(run: str) -> list[tuple[Kernel, float]]:
    ev = read_run(RUNS / run)
    records = {(r.op, tuple(sorted(r.dims.items()))): r.seconds for rank in ev.ranks.values() for r in rank.compute
               if is_routing_kernel(r.op)}
    return [(Kernel(op, dims), seconds) for (op, dims), seconds in records.items()]


def errors(hw: Hardware, run: str) -> dict[str, float]:
    """file / measured - 1 for each routing pass of the run's own sweep."""
    found = routing_records(run)
    assert {k.name for k, _ in found} == {f"{n}.{p}" for n in ("router.topk", "moe.permute", "moe.unpermute")
                                          for p in ("fwd", "bwd")}
    return {k.name: kernel_seconds(hw, k, "bf16", "fp32") / s - 1 for k, s in found}


def test_the_file_prices_the_routing_passes_the_held_out_run_measured():
    for name, error in errors(load_hardware("H200"), "sequential").items():
        assert abs(error) < KERNEL_BAR, name


def test_the_top_k_with_the_load_balancing_loss_is_its_own_chain():
    # ~20 us more than without the loss at any token count (its softmax over all experts, the loss's sums): priced as
    # router.topk_aux, the held-out run's top-k lands within 2%; without those entries, at the default kernel's price
    hw = load_hardware("H200")
    assert {"router.topk_aux.fwd", "router.topk_aux.bwd"} <= dict(hw.memory.fixed_by_kernel).keys()
    plain = without(hw, lambda name: name.startswith("router.topk_aux."))
    assert all(abs(errors(hw, "sequential")[f"router.topk.{p}"]) < 0.02 for p in ("fwd", "bwd"))
    assert all(errors(plain, "sequential")[f"router.topk.{p}"] < -0.25 for p in ("fwd", "bwd"))


def test_without_the_routing_fit_the_passes_are_priced_far_too_fast():
    found = errors(without_routing_fit(load_hardware("H200")), "sequential")
    assert all(e < -0.2 for e in found.values())
    assert all(e < -0.7 for name, e in found.items() if not name.startswith("moe.unpermute"))


def test_the_routing_fit_brings_the_held_out_grouped_moe_step_closer():
    # -10.8% without the routing passes' fit, -9.5% with it; within the goal (-4.3%) while the full-load power factor
    # over-priced the GEMMs; at the factor of the step's share the routing kernels and host waits it leaves out show
    # (docs/formulas.md, "The power limit in a step")
    v = validate_run(RUNS / "grouped")
    before = simulate(v.sim.cfg, without_routing_fit(load_hardware("H200"))).step.step_time
    assert before / v.measured.step_time - 1 < v.errors()["step_time"] < -STEP_GOAL
    assert v.errors()["step_time"] - (before / v.measured.step_time - 1) > 0.01


def test_the_sequential_run_stays_short_by_the_hosts_stalls_the_device_model_does_not_price():
    # SequentialMLP reads the counts and launches each expert at a row count cuBLAS may not have seen (BENCHMARKS.md,
    # 2026-12-03): its step stays 10-20% over the prediction; the routing fit moved it, not past the goal.
    v = validate_run(RUNS / "sequential")
    before = simulate(v.sim.cfg, without_routing_fit(load_hardware("H200"))).step.step_time
    assert -0.20 < v.errors()["step_time"] < -0.10
    assert v.sim.step.step_time > before


# ---- the per-pass fit's bounds (synthetic points: plumbing) ----------------------------------------------------

def test_a_pass_that_grows_with_its_bytes_gets_its_fixed_cost_and_efficiency():
    fixed, eff = fit_routing_pass([(s, 20e-6 + s / 0.4) for s in (10e-6, 20e-6, 40e-6)])
    assert fixed == pytest.approx(20e-6) and eff == pytest.approx(0.4)


def test_a_pass_that_does_not_grow_with_its_bytes_is_a_fixed_cost_at_full_bandwidth():
    fixed, eff = fit_routing_pass([(10e-6, 300e-6), (20e-6, 290e-6), (40e-6, 305e-6)])
    assert eff == 1.0 and 250e-6 < fixed < 300e-6


def test_a_pass_with_no_fixed_cost_goes_through_the_origin():
    points = [(10e-6, 15e-6), (20e-6, 38e-6), (40e-6, 81e-6)]
    fixed, eff = fit_routing_pass(points)
    assert fixed == 0.0 and min(s / t for s, t in points) < eff < max(s / t for s, t in points)


# ---- the experts' GEMMs on their own grid (runs/bench/hardware_sweep.py --experts; not in the fit) -------------

EXPERT_GRID = FIXTURES.parent.parent / "runs/bench/results/2026-12-04_h200_hardware_sweep_experts.json.gz"


def expert_gemm_errors() -> list[tuple[str, dict[str, int], float]]:
    """(name, dims, file / measured - 1) of each expert GEMM the grid timed on one H200."""
    records = json.load(gzip.open(EXPERT_GRID, "rt"))["records"]
    hw = load_hardware("H200")
    return [(r["op"], r["dims"], kernel_seconds(hw, Kernel(r["op"], tuple(sorted(r["dims"].items())), r["flops"]),
                                                "bf16", "fp32") / r["seconds"] - 1) for r in records]


def test_the_gemm_fit_prices_the_experts_fprop_and_dgrad_from_a_thousand_rows_within_seven_percent():
    found = [(op, d, e) for op, d, e in expert_gemm_errors() if not op.endswith("wgrad") and d["m"] >= 1024]
    assert len(found) >= 16 and all(abs(e) < 0.07 for _, _, e in found), found


def test_the_gemm_fit_prices_an_experts_wgrad_reducing_over_two_thousand_rows_within_seven_percent():
    # Over 512-1,024 rows a large expert's wgrad runs 12-27% slower than the fit says (no linear form over the grid
    # reaches it: BENCHMARKS.md, 2026-12-04 fifth entry); from 2,048 rows it is priced as the dense ones are.
    found = [(op, d, e) for op, d, e in expert_gemm_errors() if op.endswith("wgrad") and d["k"] >= 2048]
    assert len(found) >= 4 and all(abs(e) < 0.07 for _, _, e in found), found
