"""The runs recorded on real machines and committed under tests/fixtures (each folder's README says how it was made),
and the one reconciliation row a claim about them reads."""
from __future__ import annotations

from pathlib import Path

from ledger.reconcile.hta import HtaChoice
from ledger.reconcile.run import Reconciliation, TimeSources, TraceWork, reconcile

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
# HTA's cross-check runs in a process of its own per traced GPU rank (seconds each); tests/test_reconcile_hta.py and
# the fixtures' own tests judge it, a claim about another row does not need it.
WITHOUT_HTA = TraceWork(hta=HtaChoice.parse("none"))


def reconcile_recorded(run_dir: str | Path, sources: TimeSources = TimeSources()) -> Reconciliation:
    """reconcile(run_dir) without the HTA cross-check: every other row as `train-ledger reconcile` writes it."""
    return reconcile(run_dir, WITHOUT_HTA, sources)


def only(result, metric: str, **where):
    """The single row of `metric` whose fields equal `where` (rank=0, ...); fails naming what it found otherwise."""
    found = [r for r in result.rows if r.metric == metric and all(getattr(r, k) == v for k, v in where.items())]
    assert len(found) == 1, (metric, where, found)
    return found[0]
