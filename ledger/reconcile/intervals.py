"""Interval arithmetic on (start, end) pairs: the union of busy time and how much of a span it covers."""
from __future__ import annotations

from typing import Iterable

Interval = tuple[float, float]


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Disjoint, sorted intervals covering exactly the same points."""
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(s, e) for s, e in merged]


def covered(span: Interval, disjoint: list[Interval]) -> float:
    """Length of `span` covered by `disjoint` (the output of `union`)."""
    lo, hi = span
    total = 0.0
    for start, end in disjoint:
        if end <= lo:
            continue
        if start >= hi:
            break
        total += min(end, hi) - max(start, lo)
    return total


def length(disjoint: list[Interval]) -> float:
    return sum(e - s for s, e in disjoint)
