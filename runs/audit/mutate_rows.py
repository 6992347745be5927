"""A pytest plugin for runs/audit/row_mutations.py: every ledger row named $MUTATE_METRIC is predicted by its own
measurement and judged "ok", as if its predictor returned the measurement and its tolerance were infinite.

It patches ledger.reconcile.rows.judge, which every judged row's verdict goes through (row, predicted_row,
upper_bound_row, at_most_row); threshold, identity and measured-only rows never reach it. The first time the mutation
applies in a process it appends the metric to $MUTATE_ROWS_LOG, so the audit can tell "no test failed" from "no test
built the row".
"""
from __future__ import annotations

import os
import sys

import ledger.reconcile.rows as rows

METRIC = os.environ["MUTATE_METRIC"]
LOG = os.environ.get("MUTATE_ROWS_LOG")
_judge = rows.judge
_applied = False


def _mutated(actual: float, reference: float, tolerance: float,
             abs_tolerance: float = 0.0) -> tuple[float, float | None, str]:
    global _applied
    caller = sys._getframe(1).f_locals  # row(): its `metric` argument and the Row `r` it is judging
    if caller.get("metric") != METRIC:
        return _judge(actual, reference, tolerance, abs_tolerance)
    judged = caller.get("r")
    if judged is not None and judged.measured is not None:
        judged.predicted = judged.measured
    if not _applied and LOG:
        with open(LOG, "a", encoding="utf-8") as f:
            f.write(METRIC + "\n")
    _applied = True
    return 0.0, 0.0, "ok"


rows.judge = _mutated
