"""The runs recorded on real machines and committed under tests/fixtures (each folder's README says how it was made),
and the one reconciliation row a claim about them reads."""
from __future__ import annotations

from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def only(result, metric: str, **where):
    """The single row of `metric` whose fields equal `where` (rank=0, ...); fails naming what it found otherwise."""
    found = [r for r in result.rows if r.metric == metric and all(getattr(r, k) == v for k, v in where.items())]
    assert len(found) == 1, (metric, where, found)
    return found[0]
