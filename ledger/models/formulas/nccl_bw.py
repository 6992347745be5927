"""nccl-tests bandwidth conventions (nccl-tests doc/PERFORMANCE.md).

algbw = size / time, where size is the collective's full buffer (the gathered output of all-gather, the input of
reduce-scatter, the buffer of all-reduce). busbw = algbw x factor, the factor being the fraction of `size` each rank
must move over its busiest link in the optimal (ring) algorithm, so busbw is comparable with the hardware's link
bandwidth whatever the collective and group size:
all-reduce 2(n-1)/n; all-gather, reduce-scatter, all-to-all (n-1)/n; broadcast, reduce, send/recv 1 (all-to-all:
each rank keeps 1/n of its buffer and sends the rest, nccl-tests' alltoall_perf factor).
"""
from __future__ import annotations

from common.errors import ConfigError

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "reduce", "send_recv")


def bus_factor(kind: str, n: int) -> float:
    if kind not in KINDS:
        raise ConfigError(f"unknown collective {kind!r} (one of {', '.join(KINDS)})")
    if n < 1:
        raise ConfigError(f"group size must be >= 1, got {n}")
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0


def algbw(size_bytes: float, seconds: float) -> float:
    """Bytes per second."""
    return size_bytes / seconds


def busbw(size_bytes: float, seconds: float, kind: str, n: int) -> float:
    return algbw(size_bytes, seconds) * bus_factor(kind, n)
