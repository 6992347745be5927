"""runs/audit/row_mutations.py, the audit that breaks a row's predictor and looks for the test that notices, on the
Megatron-LM FLOP-count row: the test that a clean run agrees cannot notice (a predictor that returned the measurement
agrees too), the test that corrupts the measurement does, and a metric no test builds is said to be so."""
from __future__ import annotations

import pytest

from tests.support.bench import bench_script

METRIC = "megatron.flops_per_step"
AGREES = "tests/test_reconcile_megatron.py::test_megatrons_flop_count_is_the_ledgers"
CORRUPTS = "tests/test_recorded_rows_go_off.py::test_a_recorded_row_goes_off_when_its_measurement_is_wrong"


@pytest.fixture(scope="module")
def row_mutations():
    return bench_script("row_mutations", "audit")


@pytest.mark.slow
def test_the_audit_tells_a_test_that_notices_from_one_that_cannot(row_mutations):
    assert row_mutations.audit(METRIC, [AGREES], slow=False, workers=1)[0] == "NOT CAUGHT"
    caught, _ = row_mutations.audit(METRIC, [f"{CORRUPTS}[Megatron's FLOP count]"], slow=False, workers=1)
    assert caught == f"{CORRUPTS}[Megatron's FLOP count]"
    assert row_mutations.audit("no.such.metric", [AGREES], slow=False, workers=1)[0] == "never built"
