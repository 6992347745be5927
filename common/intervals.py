"""Interval arithmetic on (start, end) pairs: the union of busy time, busy time with holes cut out (compute minus
the waits nested inside it), and how much of a span it covers."""
from __future__ import annotations

from bisect import bisect_right
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


def subtract(disjoint: list[Interval], holes: list[Interval]) -> list[Interval]:
    """`disjoint` (the output of `union`) without the points of `holes` (also disjoint): what is left of compute
    once the stalls nested in it are cut out."""
    out: list[Interval] = []
    first = 0  # both lists are sorted: holes ending before the current interval never matter again
    for start, end in disjoint:
        while first < len(holes) and holes[first][1] <= start:
            first += 1
        cursor, i = start, first
        while i < len(holes) and holes[i][0] < end:
            if holes[i][0] > cursor:
                out.append((cursor, holes[i][0]))
            cursor = max(cursor, holes[i][1])
            i += 1
        if cursor < end:
            out.append((cursor, end))
    return out


def covered(span: Interval, disjoint: list[Interval]) -> float:
    """Length of `span` covered by `disjoint` (the output of `union`, so sorted by end too: a binary search finds the
    first interval that can reach the span, which keeps a trace's hundred thousand kernels cheap to query)."""
    lo, hi = span
    total = 0.0
    i = bisect_right(disjoint, lo, key=_end)
    while i < len(disjoint) and disjoint[i][0] < hi:
        start, end = disjoint[i]
        total += min(end, hi) - max(start, lo)
        i += 1
    return total


def _end(interval: Interval) -> float:
    return interval[1]


def length(disjoint: list[Interval]) -> float:
    return sum(e - s for s, e in disjoint)
