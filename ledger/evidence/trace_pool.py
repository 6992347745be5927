"""A run's traces summarised in parallel: one worker process per core (at most one per trace), each reading whole
traces and sending back only their small TraceSummary (ledger.evidence.traces), so the parent never holds more than
the summaries however large the traces are. `in_workers` is the pool itself, for any per-trace job (export-trace's
write pass is another).

Workers come from a forkserver: a fork of a threaded parent (the dashboard computes reconciliations live) can
deadlock, and the server forks clean workers that have the trace reader already imported. How many workers:
`workers` when given (the commands' --workers), else TRAIN_LEDGER_WORKERS, else the cores this process may run on,
never more than there are traces; unasked, traces of less than POOL_MIN_BYTES in all are read in this process, where
starting the pool would cost more than it saves (a 270k-event trace, 5-8 MB of gzip, takes about 0.5 s). The first
trace (in the order given) that cannot be read is the InputError raised, whatever order the workers finish in.
"""
from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence, TypeVar

from common.errors import ConfigError
from ledger.evidence.traces import TraceSummary, summarize

ENV = "TRAIN_LEDGER_WORKERS"
POOL_MIN_BYTES = 4 << 20
T = TypeVar("T")
R = TypeVar("R")


def worker_count(requested: int | None, jobs: int) -> int:
    """Processes to read `jobs` traces with: `requested`, else $TRAIN_LEDGER_WORKERS, else the usable cores; never
    more than there are traces."""
    source = "--workers"
    if requested is None and os.environ.get(ENV):
        source, text = f"{ENV}", os.environ[ENV]
        try:
            requested = int(text)
        except ValueError:
            raise ConfigError(f"{ENV}={text!r}: expected a number of worker processes (1 or more)") from None
    if requested is not None and requested < 1:
        raise ConfigError(f"{source} {requested}: expected a number of worker processes (1 or more)")
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(requested or cores, jobs))


def pool_size(workers: int | None, paths: Sequence[Path]) -> int:
    """worker_count for jobs on these traces; 1 (this process) when none was asked for and they are small."""
    if workers is None and not os.environ.get(ENV) and sum(_size(p) for p in paths) < POOL_MIN_BYTES:
        return 1
    return worker_count(workers, len(paths))


def in_workers(job: Callable[[T], R], items: Iterable[T], count: int) -> Iterator[R]:
    """job(item) for each item, in `count` forkserver processes (in this one when count is 1), in the order of the
    items; an error raised by a job ends the pool, cancelling the jobs not started, and is raised here."""
    if count == 1:
        yield from map(job, items)
        return
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["ledger.evidence.traces"])
    with ProcessPoolExecutor(max_workers=count, mp_context=context) as pool:
        try:
            yield from pool.map(job, items)
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise


def read_trace_summaries(traces: Sequence[tuple[int, Path]], workers: int | None = None,
                         progress: Callable[[str], None] = lambda _: None) -> dict[Path, TraceSummary]:
    """Each (rank, path)'s summary, keyed by path (a rank may have several traces), in the order given."""
    paths = [p for _, p in traces]
    count = pool_size(workers, paths)
    progress(f"reading {len(traces)} trace{'s' if len(traces) > 1 else ''}" +
             (f" in {count} processes" if count > 1 else ""))
    out: dict[Path, TraceSummary] = {}
    for i, ((rank, path), summary) in enumerate(zip(traces, in_workers(summarize, paths, count)), 1):
        out[path] = summary
        progress(f"read trace {i}/{len(traces)} (rank {rank})")
    return out


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0  # summarize says what is wrong with it
