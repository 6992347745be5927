"""Four GPU-bound shapes no committed run had (runs/bench/new_shapes.py --set power: llama3.1-8b at seq 8192, eight
llama3.2-1b layers at micro-batch 2, hidden 5120 at seq 2048, llama3.2-1b at seq 1024 and micro-batch 8), predicted
from config and the H200 file before one H200 ran them (the predictions committed in ec0f8ec,
runs/bench/results/2026-12-05_power_shapes_predictions.txt; the runs are tests/fixtures/h200_power_shapes, 10 steps
each with --all-probes, BENCHMARKS.md 2026-12-05). They judge the power limit's factor at each step's own compute-bound
share (docs/formulas.md, "The power limit in a step") against the sweep's full-load factor every step took before."""
from __future__ import annotations

import dataclasses
from functools import lru_cache
from statistics import mean

import pytest

from ledger.models.simulate.hardware import Hardware, load_hardware
from ledger.models.simulate.simulation import simulate
from ledger.reconcile.validation import Validation, validate_run
from tests.support.recorded_runs import FIXTURES

RUNS = FIXTURES / "h200_power_shapes"
NAMES = ("pw_llama8b_l2_s8192", "pw_llama1b_l8_s4096_mbs2", "pw_h5120_l2_s2048_mbs2", "pw_llama1b_s1024_mbs8")


@lru_cache(maxsize=None)
def validation(name: str) -> Validation:
    return validate_run(RUNS / name, "H200")


def full_load(hw: Hardware) -> Hardware:
    """The same file without its power_limit block: every step at the sweep's full-load factor."""
    return dataclasses.replace(hw, sustained=dataclasses.replace(hw.sustained, threshold_share=None))


def full_load_error(name: str) -> float:
    v = validation(name)
    return simulate(v.sim.cfg, full_load(load_hardware("H200"))).step.step_time / v.measured.step_time - 1


@pytest.mark.parametrize("name", NAMES)
def test_each_step_lands_within_three_and_a_half_percent_and_its_peak_within_a_tenth_of_one(name):
    # -0.9%, -0.6%, -2.7%, -3.4% on the step; the peaks within 0.02%
    errors = validation(name).errors()
    assert abs(errors["step_time"]) < 0.035 and abs(errors["peak_bytes"]) < 0.001


def test_the_steps_own_share_predicts_them_closer_than_the_full_load_factor():
    # At the full-load factor (x1.136-1.160 where the share gives x1.076-1.106) the four land +3.6%, +3.9%, +3.3%,
    # +3.8%: a mean |error| of 3.6% against the share's 1.5%, closer on all four (the seq-1024 micro-batch-8 step ran
    # 3.4% over the share's prediction, and +2.1% at the full factor, while its flash attention was priced at seq
    # 2048's efficiency; -1.6% and +3.8% since seq 1024 has a curve of its own, 2026-12-05 fourth entry).
    share = {name: validation(name).errors()["step_time"] for name in NAMES}
    full = {name: full_load_error(name) for name in NAMES}
    assert all(full[name] > share[name] + 0.03 for name in NAMES)  # the full factor prices every one slower
    assert mean(map(abs, share.values())) < mean(map(abs, full.values())) - 0.01
    assert all(abs(share[name]) < abs(full[name]) for name in NAMES)
