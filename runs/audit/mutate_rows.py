"""A pytest plugin for runs/audit/row_mutations.py: every ledger row named $MUTATE_METRIC is judged "ok", as if its
predictor returned the measurement, its tolerance were infinite, or its limits (a threshold row) were never reached.

Two patches in ledger.reconcile.rows: `judge`, which every verdict against a reference goes through (row,
predicted_row, upper_bound_row, at_most_row), also sets such a row's prediction to its measurement; and `Row`, whose
construction a threshold row's verdict is decided in, turns its warn or off into ok. Identity rows keep theirs. The
first time a row of the metric is built in a process, the metric is appended to $MUTATE_ROWS_LOG, so the audit can tell
"no test failed" from "no test built the row".
"""
from __future__ import annotations

import os
import sys

import ledger.reconcile.rows as rows

METRIC = os.environ["MUTATE_METRIC"]
LOG = os.environ.get("MUTATE_ROWS_LOG")
_judge = rows.judge
_built = False


def _log_built() -> None:
    global _built
    if not _built and LOG:
        with open(LOG, "a", encoding="utf-8") as f:
            f.write(METRIC + "\n")
    _built = True


def _mutated_judge(actual: float, reference: float, tolerance: float,
                   abs_tolerance: float = 0.0) -> tuple[float, float | None, str]:
    caller = sys._getframe(1).f_locals  # row(): its `metric` argument and the Row `r` it is judging
    if caller.get("metric") != METRIC:
        return _judge(actual, reference, tolerance, abs_tolerance)
    judged = caller.get("r")
    if judged is not None and judged.measured is not None:
        judged.predicted = judged.measured
    return 0.0, 0.0, "ok"


class _MutatedRow(rows.Row):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.metric == METRIC:
            _log_built()
            if self.verdict in ("warn", "off"):
                self.verdict = "ok"


rows.judge = _mutated_judge
rows.Row = _MutatedRow
