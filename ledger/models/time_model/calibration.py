"""What the time model knows about the machine: measured kernel times, per-element rates and the link fits.

Built from a run directory's `compute` events (probes/compute_sweep/: one record per catalogue kernel of the run's
own shapes, `{"op", "dims", "dtype", "seconds", ...}`) and `bandwidth` events (the collective sweep), never from the
step times of a run being judged. Several ranks' records of one kernel give their median. A later `simulate` builds
the same object from a hardware file instead.

A GPU computes slower in a training step than in the sweep's isolated timings: under continuous load it sits at its
power limit, at lower clocks, and every kernel running at that clock slows about alike (timed one by one inside the
sweep's loop on an H200: runs/bench/sustained_split.py). The sweep's "sustained.layer" record times a layer's kernels
back to back at that limit; its full-load factor = that time / the same kernels' isolated time (1 when the record is
absent: a CPU sweep). A step draws less than that loop: its memory-bound kernels, its update and its idle gaps leave
the compute-bound kernels (GEMMs, attention) a smaller share of its time, and the clock drops less. `power`
(PowerLimit) holds how much: the factor a step sees rises from 1 at `threshold_share` (the compute-bound share of wall
time below which the GPU stays under its limit at boost clock, a hardware file's measurement) to the full factor at
the record's own share, along a line; predict_step finds the step's share and sets `sustained`, which multiplies
every kernel of the passes (not the per-element rates: the update and the memset run apart from them). A layer so
small that the host cannot keep the sweep's back-to-back kernels fed times the host instead: a "slowdown" beyond
MAX_SUSTAINED, more than any clock drop at the power limit explains, is read as that and taken as 1 (the
calibration's note says so).

CPU ranks that outnumber their host's cores compute slower than the sweep measured them (it runs one rank at a time
per host): `compute_scale` multiplies every kernel and rate by how much, from the cores, the ranks per host and the
threads each rank runs (`oversubscription`).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from statistics import median
from typing import Iterable

from common.events import BandwidthRecord, ComputeRecord
from common.ops import SUSTAINED, Kernel
from common.ops.rank import PER_ELEMENT
from ledger.models.time_model.comm import CommModel
from ledger.models.time_model.host_costs import HostCosts
from ledger.models.time_model.missing import CalibrationMissing

KernelKey = tuple[str, tuple[tuple[str, int], ...], str]
# An H200's boost clock over its clock at the power limit in training (1,980 / ~1,470 MHz: probes/compute_sweep/
# sustained.py): no kernel slows more than this under sustained load.
MAX_SUSTAINED = 1.35
HOST_PACED = ("the compute sweep's sustained.layer record is host-paced (a slowdown of x{:.2f}, beyond any clock "
              "drop): kernels taken at their isolated speed")


def oversubscription(ranks: int, cores: int, threads: int) -> float:
    """How much slower a rank computes when `ranks` processes of `threads` threads share `cores` cores than when it
    ran alone (the sweep): alone it had min(threads, cores) cores, all busy each has cores / ranks."""
    return max(1.0, min(threads, cores) * ranks / cores)


@dataclass(frozen=True)
class PowerLimit:
    """The slowdown of a step's kernels as a function of the share of its wall time the compute-bound ones fill: 1 up
    to `threshold_share`, `full_factor` at `full_share` (the sweep's back-to-back record), linear between
    (docs/formulas.md, "The power limit in a step"); without a threshold (a sweep alone measures none) the full factor
    throughout."""
    full_factor: float
    full_share: float
    threshold_share: float | None = None

    def factor(self, share: float) -> float:
        if self.threshold_share is None or self.full_share <= self.threshold_share:
            return self.full_factor
        reached = (share - self.threshold_share) / (self.full_share - self.threshold_share)
        return 1.0 + (self.full_factor - 1.0) * min(1.0, max(0.0, reached))


def _key(name: str, dims: dict[str, int], dtype: str) -> KernelKey:
    return name, tuple(sorted((k, int(v)) for k, v in dims.items())), dtype


@dataclass(frozen=True)
class Calibration:
    kernels: dict[KernelKey, float]  # seconds per call
    rates: dict[tuple[str, str], float]  # (op, dtype) -> seconds per element
    comm: CommModel
    device: str = "unknown device"
    sustained: float = 1.0  # slowdown of the passes' kernels in the step priced (predict_step sets it from power)
    power: PowerLimit | None = None  # None: no sustained record, the kernels at their isolated speed
    compute_scale: float = 1.0
    scale_note: str | None = None
    host: HostCosts | None = None  # the host timeline's prices (None: off, `host_note` says why)
    host_note: str | None = None

    @property
    def notes(self) -> tuple[str, ...]:
        return tuple(n for n in (self.scale_note, self.host_note) if n)

    @classmethod
    def from_records(cls, compute: Iterable[ComputeRecord], bandwidth: Iterable[BandwidthRecord],
                     compute_scale: float = 1.0, scale_note: str | None = None, host: HostCosts | None = None,
                     host_note: str | None = None) -> "Calibration":
        seconds: dict[KernelKey, list[float]] = defaultdict(list)
        per_element: dict[tuple[str, str], list[float]] = defaultdict(list)
        sustained: list[tuple[float, float]] = []  # (full-load factor, compute-bound share of the record's pass)
        devices = set()
        for r in compute:
            devices.add(r.device or "unknown device")
            dtype = r.dtype or ""
            if r.op == SUSTAINED:
                compute_bound = r.compute_bound_s or 0.0
                isolated = compute_bound + (r.memory_bound_s or 0.0)
                if compute_bound > 0 and r.seconds > 0:
                    sustained.append((r.seconds / isolated, compute_bound / isolated))
            elif r.op in PER_ELEMENT:
                per_element[(r.op, dtype)].append(r.seconds / int(r.dims["numel"]))
            else:
                seconds[_key(r.op, r.dims, dtype)].append(r.seconds)
        factor = max(1.0, median(f for f, _ in sustained)) if sustained else 1.0
        power = PowerLimit(factor, median(share for _, share in sustained)) if sustained else None
        if factor > MAX_SUSTAINED:
            host_note = "; ".join(n for n in (host_note, HOST_PACED.format(factor)) if n)
            factor, power = 1.0, None
        return cls(kernels={k: median(v) for k, v in seconds.items()},
                   rates={k: median(v) for k, v in per_element.items()}, comm=CommModel.from_sweep(bandwidth),
                   device=", ".join(sorted(devices)) or "unknown device", sustained=factor, power=power,
                   compute_scale=compute_scale, scale_note=scale_note, host=host, host_note=host_note)

    def over(self, fallback: "Calibration") -> "Calibration":
        """This calibration, with what it lacks taken from `fallback` (a hardware file's, for the kernels a sweep
        never timed): its kernels and rates first, its link fits where it has any, its power limit where it
        measured one, its host prices where it has them."""
        measured = bool(self.kernels or self.rates)
        own = measured and self.sustained > 1.0
        own_host = self.host is not None or fallback.host is None
        host, host_note = (self.host, self.host_note) if own_host else (fallback.host, fallback.host_note)
        return Calibration(kernels={**fallback.kernels, **self.kernels}, rates={**fallback.rates, **self.rates},
                           comm=self.comm if self.comm.fits else fallback.comm,
                           device=f"{self.device}, else {fallback.device}",
                           sustained=self.sustained if own else fallback.sustained,
                           power=self.power if own else fallback.power,
                           compute_scale=self.compute_scale, scale_note=self.scale_note, host=host,
                           host_note=host_note)

    def kernel_seconds(self, kernel: Kernel, dtype: str) -> float:
        found = self.kernels.get((kernel.name, kernel.dims, dtype))
        if found is None:
            raise CalibrationMissing(self._absent(f"{kernel.describe()} ({dtype})"))
        return found * self.compute_scale * self.sustained

    def rate_seconds(self, op: str, dtype: str, numel: int) -> float:
        found = self.rates.get((op, dtype))
        if found is None:
            raise CalibrationMissing(self._absent(f"{op} ({dtype})"))
        return found * numel * self.compute_scale

    def _absent(self, what: str) -> str:
        if not self.kernels and not self.rates:
            return ("no compute sweep records (--compute-sweep): no compute time predictions (reconcile and report "
                    "price such a run from a hardware file, --hardware with the run's GPU kind, e.g. H200, or a "
                    "`train-ledger calibrate` file, --calibration FILE)")
        return f"the compute sweep (--compute-sweep) has no record of {what}: no compute time predictions"
