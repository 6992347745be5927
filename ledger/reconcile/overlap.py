"""DP bucket overlap, per bucket and per rank: how much of each bucket's reduce-scatter / all-reduce / all-gather
ran while the same rank was computing, and how much was exposed.

Two sources, each its own rows: the probes' timers (`dp-comm` records with a bucket, issue -> wait returned, so an
upper bound of the collective's true interval) and the profiler trace (the NCCL kernels on the DP group, matched to
buckets in issue order within each ProfilerStep, against compute kernels). Compute is the union of the rank's
forward / backward ranges (timers) or non-communication kernels (trace). Figures are averaged over the steps seen.

Expected overlap with --overlap-grad-reduce: every bucket but the last one issued, which starts after the last
backward op and has only the other buckets' traffic left to hide behind.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from statistics import mean

from common.config import RunConfig
from ledger.reconcile.bandwidth import predicted_time
from ledger.reconcile.evidence import RankEvidence, RunEvidence
from ledger.reconcile.intervals import covered, union
from ledger.reconcile.rows import Row, row, upper_bound_row
from ledger.traces import TraceSummary, normalize_op

COMPUTE_CATEGORIES = ("forward", "backward")
GRAD_OPS = ("reduce_scatter", "all_reduce")
FRACTION_TOL = 0.25
TIME_TOL = 0.5


@dataclass
class BucketInterval:
    """One bucket's collective in one step on one rank: what the dashboard draws and the rows average."""
    rank: int
    step: int
    bucket: int
    op: str
    start: float
    end: float
    overlapped: float
    bytes: int | None

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def exposed(self) -> float:
        return self.duration - self.overlapped


def timer_intervals(r: RankEvidence) -> list[BucketInterval]:
    by_step: dict[int, list[dict]] = defaultdict(list)
    for t in r.timing:
        by_step[t.get("step")].append(t)
    out = []
    for step, records in by_step.items():
        busy = union((t["start_s"], t["end_s"]) for t in records if t.get("category") in COMPUTE_CATEGORIES)
        for t in records:
            if t.get("category") == "dp-comm" and t.get("bucket") is not None:
                span = (t["start_s"], t["end_s"])
                out.append(BucketInterval(rank=r.rank, step=step, bucket=int(t["bucket"]),
                                          op=normalize_op(t.get("name", "")) or "unknown", start=span[0], end=span[1],
                                          overlapped=covered(span, busy), bytes=t.get("bytes")))
    return out


def trace_intervals(summary: TraceSummary, rank: int, dp_group: tuple[int, ...]) -> list[BucketInterval]:
    """DP-group collectives in each ProfilerStep, numbered per op in issue order (bucket 0 first)."""
    busy = union(summary.compute)
    out = []
    for step, (lo, hi) in summary.windows().items():
        seen: dict[str, int] = defaultdict(int)
        for c in summary.collectives:
            on_dp = c.group is not None and tuple(sorted(c.group)) == dp_group
            if not on_dp or not lo <= c.start <= hi or c.op not in GRAD_OPS + ("all_gather",):
                continue
            bucket = seen[c.op]
            seen[c.op] += 1
            out.append(BucketInterval(rank=rank, step=step, bucket=bucket, op=c.op, start=c.start / 1e6,
                                      end=c.end / 1e6, overlapped=covered((c.start, c.end), busy) / 1e6,
                                      bytes=c.bytes))
    return out


def bucket_rows(cfg: RunConfig | None, r: RankEvidence, intervals: list[BucketInterval], source: str) -> list[Row]:
    groups: dict[tuple[str, int], list[BucketInterval]] = defaultdict(list)
    for i in intervals:
        groups[(i.op, i.bucket)].append(i)
    overlap_on = cfg is not None and cfg.train.overlap_grad_reduce
    rows: list[Row] = []
    for (op, bucket), items in sorted(groups.items()):
        last = bucket == max(b for o, b in groups if o == op)
        where = dict(rank=r.rank, stage=r.stage, bucket=bucket, source=source)
        duration = mean(i.duration for i in items)
        fraction = mean(i.overlapped / i.duration if i.duration > 0 else 0.0 for i in items)
        expected = _expected_fraction(op, last, overlap_on, cfg)
        rows.append(row(f"overlap.{op}.overlapped_fraction", "bucket", predicted=expected, measured=fraction,
                        unit="fraction", tolerance=FRACTION_TOL,
                        explanation=f"share of the bucket's {op} interval during compute on this rank, mean of "
                                    f"{len(items)} step(s) ({source}); " + _why(op, last, overlap_on),
                        **where))
        rows.append(row(f"overlap.{op}.exposed_time", "bucket", measured=mean(i.exposed for i in items), unit="s",
                        tolerance=TIME_TOL, explanation="time the bucket's collective ran with no compute beside it",
                        **where))
        nbytes = items[0].bytes
        pred = predicted_time(r.bandwidth, op, "dp", nbytes) if nbytes else None
        judged = upper_bound_row if source == "timers" else row
        rows.append(judged(f"overlap.{op}.comm_time", "bucket", predicted=pred[0] if pred else None,
                           measured=duration, unit="s", tolerance=TIME_TOL,
                           explanation=(pred[1] if pred else "no bandwidth sweep point for this op/group")
                           + (f"; {nbytes:,} bytes" if nbytes else "")
                           + ("; timers span issue -> wait returned (an upper bound)" if source == "timers" else ""),
                           **where))
    if intervals:
        steps = {i.step for i in intervals}
        rows.append(row("overlap.exposed_dp_comm_per_step", "rank",
                        measured=sum(i.exposed for i in intervals) / len(steps), unit="s", tolerance=TIME_TOL,
                        explanation=f"DP communication not hidden behind compute, per step ({source})",
                        rank=r.rank, stage=r.stage, source=source))
    return rows


def _expected_fraction(op: str, last: bool, overlap_on: bool, cfg: RunConfig | None) -> float | None:
    if cfg is None or last:
        return None
    if op == "all_gather":
        return 1.0 if cfg.train.overlap_param_gather else 0.0
    return 1.0 if overlap_on else 0.0


def _why(op: str, last: bool, overlap_on: bool) -> str:
    if last:
        return "the last bucket issued has no backward left to hide behind (no prediction)"
    if op == "all_gather":
        return "--overlap-param-gather hides all-gathers behind the next forward"
    return "--overlap-grad-reduce issues buckets during backward" if overlap_on else \
        "without --overlap-grad-reduce grads are reduced after backward: no overlap expected"


def overlap_rows(ev: RunEvidence) -> list[Row]:
    rows: list[Row] = []
    for r in ev.ranks.values():
        rows += bucket_rows(ev.config, r, timer_intervals(r), "timers")
    return rows
