"""Typed event records (common.events) from the plain dicts a test writes, checked as a reader checks them."""
from __future__ import annotations

from typing import Any, Iterable

from common.events import Event, event


def typed(kind: str, fields: Iterable[dict[str, Any]]) -> list[Event]:
    """One `kind` record per dict of fields (a dict may carry its own "step"; "kind" is ignored)."""
    return [event(kind, f.get("step"), **{k: v for k, v in f.items() if k not in ("kind", "step")}) for f in fields]
