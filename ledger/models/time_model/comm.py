"""Collective time: latency + bytes moved / bus bandwidth, fitted per (group, collective) over the bandwidth sweep.

The sweep (probes/bandwidth.py, `bandwidth` events) times each collective of each group at the run's own sizes and
at a latency size (one element per rank); nccl-tests' conventions: `size_bytes` S is the all-reduce buffer, the
all-gather output, the reduce-scatter input, the bytes one rank sends. A rank moves x = S x bus factor over its
busiest link (ledger/models/formulas/nccl_bw.py: 2(n-1)/n all-reduce, (n-1)/n all-gather and reduce-scatter, 1
send/recv), so the model is

    t(S) = alpha + x / busbw,    x = S x bus_factor(collective, n)

fitted by least squares on relative error (each point weighs 1/t^2, so the small sizes set alpha and the large ones
busbw, instead of the largest point setting both). Each size's time is the slowest rank's, as nccl-tests reports a
group. One size gives busbw through the origin (alpha 0, exact at that size); a negative fitted alpha is refitted at
0. Writing the fit in bus bytes keeps busbw a property of the link, which is what lets a later `simulate` price the
same collective on a group of another size.
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable

from common.events import BandwidthRecord
from ledger.models.formulas.nccl_bw import bus_factor
from ledger.models.time_model.missing import CalibrationMissing

# A collective with no sweep of its own priced on the link another one measured: the tied-embedding all-reduce of a
# group of two (first and last pipeline rank) moves S over the same link a pipeline send of S does.
SAME_LINK = {("embedding", "all_reduce"): ("pp", "send_recv")}
# A group the bandwidth sweep records under another label: the DP buckets' collectives run on Megatron's dp_cp group
# under context parallelism and the sweep (probes/bandwidth.py) times them there, labelled "dp" (group_size dp x cp).
SWEPT_AS = {"dp_cp": "dp"}


def fit_alpha_beta(points: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """(alpha seconds, beta seconds per byte) minimising sum ((alpha + beta x - t) / t)^2 over (x, t) points."""
    pts = [(float(x), float(t)) for x, t in points if t > 0]
    if not pts:
        raise ValueError("no points to fit")
    if len({x for x, _ in pts}) == 1:
        x = pts[0][0]
        return (0.0, sum(t for _, t in pts) / len(pts) / x) if x > 0 else (sum(t for _, t in pts) / len(pts), 0.0)
    w = [1.0 / t ** 2 for _, t in pts]
    sw = sum(w)
    sx = sum(wi * x for wi, (x, _) in zip(w, pts))
    st = sum(wi * t for wi, (_, t) in zip(w, pts))
    sxx = sum(wi * x * x for wi, (x, _) in zip(w, pts))
    sxt = sum(wi * x * t for wi, (x, t) in zip(w, pts))
    beta = (sw * sxt - sx * st) / (sw * sxx - sx * sx)
    alpha = (st - beta * sx) / sw
    if alpha < 0:  # through the origin
        return 0.0, sxt / sxx
    if beta < 0:  # no size dependence resolved: latency only
        return st / sw, 0.0
    return alpha, beta


@dataclass(frozen=True)
class LinkFit:
    alpha: float  # seconds
    beta: float  # seconds per bus byte (1 / busbw)
    sizes: tuple[int, ...]  # the swept sizes (nccl-tests size, bytes)

    @property
    def busbw(self) -> float:
        return 1.0 / self.beta if self.beta > 0 else math.inf

    def seconds(self, kind: str, n: int, size_bytes: float) -> float:
        return self.alpha + self.beta * size_bytes * bus_factor(kind, n)

    def describe(self) -> str:
        return (f"alpha {self.alpha * 1e6:.1f} us + busbw {self.busbw / 1e9:.1f} GB/s "
                f"(fit over {len(self.sizes)} size(s) {min(self.sizes):,}..{max(self.sizes):,} B)")


@dataclass(frozen=True)
class CommModel:
    fits: dict[tuple[str, str], LinkFit]

    @classmethod
    def from_sweep(cls, records: Iterable[BandwidthRecord]) -> "CommModel":
        """One fit per (group label, collective) over every rank's `bandwidth` records: the slowest rank at each
        (group instance, size), then every size of every instance of that label."""
        slowest: dict[tuple[str, str, int, tuple[int, ...], int], float] = {}
        for r in records:
            if not r.time_s or not r.size_bytes:
                continue
            key = (r.group, r.collective, r.group_size, tuple(r.ranks or ()), r.size_bytes)
            slowest[key] = max(slowest.get(key, 0.0), r.time_s)
        points: dict[tuple[str, str], list[tuple[float, float, int]]] = defaultdict(list)
        for (group, kind, n, _, size), seconds in slowest.items():
            points[(group, kind)].append((size * bus_factor(kind, n), seconds, size))
        fits = {}
        for key, pts in points.items():
            alpha, beta = fit_alpha_beta((x, t) for x, t, _ in pts)
            fits[key] = LinkFit(alpha, beta, tuple(sorted({s for _, _, s in pts})))
        return cls(fits)

    def fit(self, group: str, kind: str) -> LinkFit:
        found = (self.fits.get((group, kind)) or self.fits.get((SWEPT_AS.get(group, ""), kind))
                 or self.fits.get(SAME_LINK.get((group, kind), ("", ""))))
        if found is None:
            raise CalibrationMissing(f"no bandwidth sweep of {kind} on the {group} group (--bandwidth-sweep)")
        return found

    def seconds(self, group: str, kind: str, n: int, size_bytes: float) -> float:
        """Time of one collective of `size_bytes` (nccl-tests size) over a group of n; nothing moves when n == 1."""
        if n <= 1:
            return 0.0
        return self.fit(group, kind).seconds(kind, n, size_bytes)
