"""Communication against compute, per rank: each DP bucket's collective (its interval, the part concurrent with
compute and the part exposed) and, per step, every group's exposed communication.

Two sources, each its own rows (`source`):
  * trace: the GPU timeline is the ground truth. NCCL kernel intervals against the union of compute kernels; a
    kernel's group is its "Process Group Ranks" matched against the rank's groups. CPU (gloo) traces: gloo's
    annotations (no group recorded: named by ledger.evidence.trace_groups, else group "unknown") against the
    forward / backward annotations minus the blocked time nested in them (ledger.evidence.traces).
  * timers (CUDA events, else perf_counter): an async collective spans issue -> wait returned, an upper bound of its
    interval, so every time figure from timers bounds the truth from above and is judged as a bound. Compute = the
    forward / backward ranges minus the blocking ranges nested in them: stalls (dp-wait: the DDP pre-hook waiting for
    its all-gather) and synchronous communication (a TP collective inside a forward). Without that cut a forward that
    stalls on its all-gather would count as the all-gather's overlap.
Per bucket: trace kernels are matched to the engine's buckets by size (the inventory's bucket layout) and, among
buckets of one size, by the engine's issue order; the timers carry the bucket index. Per step: a group's exposed
communication is the length of the union over time of its collectives minus compute, never a sum of per-bucket
exposed tails (finalize waits the buckets in sequence: their tails overlap in time). Steps: traces use their full
profiler steps (a step record exists: the step ended) but the run's first; timers use the steady steps
(ledger.evidence.steps). Per-group figures come from the trace where the rank has one, else from the timers.

Predictions: the overlapped fraction has a structural one from the config (all or nothing, and none for the bucket
that has nothing to hide behind); exposed time, per bucket and per step, takes the time model's (`predicted_*`
parameters, None until it is wired: the row is n/a and says so); comm_time takes the bandwidth sweep's.

Context parallelism's ring exchanges (engine/transformer/ring_attention.py) get one row per rank,
`overlap.cp_exchange.hidden_fraction`: the share of the exchanges' time (issue -> wait returned, "cp-comm") during
compute, over the steady steps. The engine issues every exchange before the attention block it runs beside and waits
after it, so what is not hidden is exactly the "cp-wait" stalls. The prediction prices both sides from the config
and this rank's calibration (ledger/models/formulas/ring_overlap.py): a message at the bandwidth sweep's send_recv time
on the cp group at its size, a block at the compute sweep's core attention rate (seconds per FLOP) times its FLOPs;
each exchange hides min(1, block / transfer), the row the byte-weighted mean. Without either sweep it is n/a and says
which is missing. The measurement weighs each exchange by its span, max(block, transfer) in the model, the
prediction by its bytes: the two agree when a step's exchanges are alike (C = 2: every message |KV|, every block the
same FLOPs).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from statistics import mean
from typing import Iterable, Mapping

from common.config import RunConfig
from common.events import (
    COMM_CATEGORY_GROUP,
    COMPUTE_CATEGORIES,
    STALL_CATEGORIES,
    ComputeRecord,
    InventoryRecord,
    TimingRecord,
)
from common.intervals import Interval, covered, length, subtract, union
from ledger.evidence.layout import group_kind
from ledger.evidence.run import RankEvidence
from ledger.evidence.steps import StepSelection, step_list
from ledger.evidence.traces import Collective, TraceSummary, normalize_op
from ledger.models.formulas.activations import local_seq_length
from ledger.models.formulas.ring_overlap import (
    BACKWARD,
    FORWARD,
    hidden_fraction,
    ring_exchanges,
)
from ledger.models.time_model import Calibration
from ledger.reconcile.bandwidth import predicted_time
from ledger.reconcile.comm import p2p_group, step_of, volume_op
from ledger.reconcile.rows import (
    NO_TIME_MODEL,
    Row,
    predicted_row,
    row,
    upper_bound_row,
)

GRAD_OPS = ("reduce_scatter", "all_reduce")
BUCKET_OPS = GRAD_OPS + ("all_gather",)
FRACTION_TOL = 0.25
TIME_TOL = 0.5
EXPOSED_TOL = 0.25
STEP_EXPOSED_ABS_S = 2e-3
BUCKET_EXPOSED_ABS_S = 2e-4
TIMER_BOUND = "timers span issue -> wait returned: an upper bound of the collective's interval"

# The time model prices a point-to-point transfer alone; the measured "pp" exposure also holds the wait for the
# peer stage (the bubble), judged by the pipeline rows, so it is not compared here.
PREDICTED_EXPOSED_GROUPS = ("dp", "tp", "embedding")
NOT_COMPARED = ("not judged: the time model's exposed time is compared for the dp, tp and embedding groups only (a "
                "pp figure holds the wait for the peer stage, which the pipeline rows judge)")


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
    expert: bool = False  # an expert buffer's bucket: its collective runs over expt_dp, not dp (docs/engine.md)

    @property
    def duration(self) -> float:
        return self.end - self.start

    @property
    def exposed(self) -> float:
        return self.duration - self.overlapped


# --- timers -------------------------------------------------------------------------------------------------------
def _by_step(records: Iterable[TimingRecord]) -> dict[int, list[TimingRecord]]:
    out: dict[int, list[TimingRecord]] = defaultdict(list)
    for t in records:
        out[t.step].append(t)
    return out


def timer_compute(records: list[TimingRecord]) -> list[Interval]:
    """Forward / backward time of one step without the blocking ranges nested in it (stalls, and synchronous
    communication: any comm range that is not an async collective)."""
    busy = union((t.start_s, t.end_s) for t in records if t.category in COMPUTE_CATEGORIES)
    blocked = union((t.start_s, t.end_s) for t in records
                    if t.category in STALL_CATEGORIES + tuple(COMM_CATEGORY_GROUP) and not t.async_comm)
    return subtract(busy, blocked)


def timer_intervals(r: RankEvidence) -> list[BucketInterval]:
    """Every DP bucket collective of every step from the timers, against that step's compute."""
    out = []
    for step, records in _by_step(r.timing).items():
        busy = timer_compute(records)
        for t in records:
            if t.category == "dp-comm" and t.bucket is not None:
                span = (t.start_s, t.end_s)
                out.append(BucketInterval(rank=r.rank, step=step, bucket=int(t.bucket),
                                          op=normalize_op(t.name) or "unknown", start=span[0], end=span[1],
                                          overlapped=covered(span, busy), bytes=t.bytes,
                                          expert=bool(t.expert)))
    return out


def timer_exposed(r: RankEvidence, steps: list[int]) -> dict[int, dict[str, float]]:
    """Per step, per group: exposed communication from the timers (a union, upper-bounded by the timers' spans)."""
    by_step = _by_step(r.timing)
    out = {}
    for step in steps:
        records = by_step.get(step, [])
        spans: dict[str, list[Interval]] = defaultdict(list)
        for t in records:
            if t.category in COMM_CATEGORY_GROUP:
                spans[COMM_CATEGORY_GROUP[t.category]].append((t.start_s, t.end_s))
        out[step] = exposed_by_group(spans, timer_compute(records))
    return out


# --- traces -------------------------------------------------------------------------------------------------------
def bucket_bytes(inventory: list[InventoryRecord]) -> dict[str, list[int]]:
    """Each DP bucket's bytes in the grad ("grad_buffer") and param ("param_buffer") buffers, numbered as the engine
    numbers its bucket groups: buffer after buffer, bucket after bucket (the inventory's order)."""
    out: dict[str, list[int]] = {"grad_buffer": [], "param_buffer": []}
    for t in inventory:
        kind = t.tensor_kind
        if kind in out and t.numel:
            element = int(t.bytes) // int(t.numel)
            out[kind] += [int(b["numel"]) * element for b in t.buckets or []]
    return out


def match_buckets(kernels: list[Collective], sizes: list[int], descending: bool) -> list[tuple[int, Collective]]:
    """(bucket, kernel) for each kernel of one op in one step, in issue order, whose size is a bucket's: a kernel of
    any other size is no bucket's (a 4-byte loss all-reduce). Among buckets of one size the engine issues in index
    order, descending for the forward pre-hooks' chained all-gathers (the first layers sit in the last bucket)."""
    queues: dict[int, list[int]] = defaultdict(list)
    for index in (reversed(range(len(sizes))) if descending else range(len(sizes))):
        queues[sizes[index]].append(index)
    out = []
    for kernel in kernels:
        queue = queues.get(kernel.bytes)
        if queue:
            out.append((queue.pop(0), kernel))
    return out


def trace_steps(summary: TraceSummary, r: RankEvidence, selection: StepSelection) -> list[int]:
    """Traced steps that count: full ones (this rank wrote their step record: the step ended inside the trace) but
    the run's first."""
    ended = {s.get("step") for s in r.steps}
    return sorted(s for s in summary.windows() if (not ended or s in ended) and s != selection.first)


def trace_intervals(summary: TraceSummary, r: RankEvidence, dp_group: tuple[int, ...],
                    cfg: RunConfig | None) -> list[BucketInterval]:
    """The DP-group bucket collectives of each traced step, matched to the engine's buckets (match_buckets)."""
    sizes = bucket_bytes(r.inventory)
    descending = cfg is not None and cfg.train.overlap_param_gather
    windows = summary.windows()
    per_step: dict[tuple[int, str], list[Collective]] = defaultdict(list)
    for c in summary.collectives:
        step = step_of(windows, c.start)
        if step is not None and c.op in BUCKET_OPS and c.group is not None and tuple(sorted(c.group)) == dp_group:
            per_step[(step, c.op)].append(c)
    out = []
    for (step, op), kernels in sorted(per_step.items()):
        buffer = "param_buffer" if op == "all_gather" else "grad_buffer"
        for bucket, c in match_buckets(kernels, sizes[buffer], descending and op == "all_gather"):
            out.append(BucketInterval(rank=r.rank, step=step, bucket=bucket, op=op, start=c.start / 1e6,
                                      end=c.end / 1e6, overlapped=covered((c.start, c.end), summary.compute) / 1e6,
                                      bytes=c.bytes))
    return out


def trace_exposed(summary: TraceSummary, groups: dict[str, tuple[int, ...]], steps: list[int],
                  p2p: str = "pp") -> dict[int, dict[str, float]]:
    """Per step, per group: exposed communication from the trace's kernels (seconds); point-to-point is `p2p`'s."""
    windows = summary.windows()
    spans: dict[int, dict[str, list[Interval]]] = {step: defaultdict(list) for step in steps}
    for c in summary.collectives:
        step = step_of(windows, c.start)
        if step in spans:
            spans[step][kernel_group(groups, c, p2p)].append((c.start, c.end))
    return {step: {g: t / 1e6 for g, t in exposed_by_group(by_group, summary.compute).items()}
            for step, by_group in spans.items()}


def kernel_group(groups: dict[str, tuple[int, ...]], c: Collective, p2p: str = "pp") -> str:
    """The group a traced collective ran on. NCCL's SendRecv kernels (and gloo's send/recv) record no ranks; the
    engine's point-to-point traffic is the pipeline's and ring attention's, so they are `p2p`'s
    (ledger.reconcile.comm.p2p_group)."""
    op = volume_op(c.op)
    return p2p if op == "send_recv" and c.group is None else group_kind(groups, c.group, op, c.issued_as)


def exposed_by_group(spans: Mapping[str, list[Interval]], compute: list[Interval]) -> dict[str, float]:
    """Each group's communication time with no compute beside it: |union(spans) - compute|."""
    return {group: length(subtract(union(s), compute)) for group, s in spans.items()}


# --- rows ---------------------------------------------------------------------------------------------------------
def bucket_rows(cfg: RunConfig | None, r: RankEvidence, intervals: list[BucketInterval], source: str, *,
                steps: list[int], note: str = "", judged_elsewhere: str | None = None,
                predicted_exposed: Mapping[tuple[str, int], float] | None = None) -> list[Row]:
    """Per (op, bucket), averaged over `steps`: overlapped fraction, exposed time (judged against
    `predicted_exposed[(op, bucket)]`, the time model's) and comm time (against the bandwidth sweep)."""
    groups: dict[tuple[str, int], list[BucketInterval]] = defaultdict(list)
    for i in intervals:
        if i.step in steps:
            groups[(i.op, i.bucket)].append(i)
    timers = source == "timers"
    suffix = f" ({source})" + (f"; {note}" if note else "") + (f"; {TIMER_BOUND}" if timers else "")
    rows: list[Row] = []
    for (op, bucket), items in sorted(groups.items()):
        last = bucket == max(b for o, b in groups if o == op)
        group = "expt_dp" if items[0].expert else "dp"
        where = dict(rank=r.rank, stage=r.stage, bucket=bucket, source=source)
        fraction = mean(i.overlapped / i.duration if i.duration > 0 else 0.0 for i in items)
        rows.append(row(f"overlap.{op}.overlapped_fraction", "bucket", predicted=_expected_fraction(op, last, cfg),
                        measured=fraction, unit="fraction", tolerance=FRACTION_TOL,
                        explanation=f"share of the bucket's {op} interval during compute on this rank, mean of "
                                    f"{step_list(i.step for i in items)}{suffix}; " + _why(op, last, cfg), **where))
        judged = upper_bound_row if timers else predicted_row
        exposed = (predicted_exposed or {}).get((op, bucket))
        extra = dict(judged_elsewhere=judged_elsewhere) if timers else {}
        rows.append(judged(f"overlap.{op}.exposed_time", "bucket", predicted=exposed,
                           measured=mean(i.exposed for i in items), unit="s", tolerance=EXPOSED_TOL,
                           abs_tolerance=BUCKET_EXPOSED_ABS_S,
                           explanation="time the bucket's collective ran with no compute beside it" + suffix
                           + (f"; {NO_TIME_MODEL}" if timers and exposed is None else ""), **extra, **where))
        nbytes = items[0].bytes
        pred = predicted_time(r.bandwidth, op, group, nbytes) if nbytes else None
        comm = upper_bound_row if timers else row
        rows.append(comm(f"overlap.{op}.comm_time", "bucket", predicted=pred[0] if pred else None,
                         measured=mean(i.duration for i in items), unit="s", tolerance=TIME_TOL,
                         explanation=(pred[1] if pred else "no bandwidth sweep point for this op/group")
                         + (f"; {nbytes:,} bytes" if nbytes else "") + suffix, **extra, **where))
    return rows


def exposed_comm_rows(r: RankEvidence, per_step: dict[int, dict[str, float]], source: str, *, note: str = "",
                      bucket_tails: float | None = None,
                      predicted: Mapping[str, float] | None = None) -> list[Row]:
    """One row per group: exposed communication per step, the mean over `per_step`'s steps of the union's length,
    judged against `predicted[group]` (the time model's) for the groups PREDICTED_EXPOSED_GROUPS names.
    `bucket_tails`: the DP buckets' exposed times summed per step, shown beside the union for the dp row."""
    if not per_step:
        return []
    timers = source == "timers"
    rows = []
    for group in sorted({g for by_group in per_step.values() for g in by_group}):
        compared = group in PREDICTED_EXPOSED_GROUPS
        judged = (upper_bound_row if timers else predicted_row) if compared else row
        measured = mean(by_group.get(group, 0.0) for by_group in per_step.values())
        pred = (predicted or {}).get(group) if compared else None
        text = (f"length of the union over time of the {group} group's collectives with no compute beside them, "
                f"mean of {step_list(per_step)} ({source})" + (f"; {note}" if note else ""))
        if timers:
            text += f"; {TIMER_BOUND}; this figure is then an upper bound of the exposed time"
        if group == "pp":
            text += ("; a point-to-point transfer runs from its issue until the peer stage is there, so this holds the "
                     "wait for the other stage (the pipeline's bubble) as well as the transfer")
        if group == "dp" and bucket_tails is not None:
            text += (f"; the buckets' exposed times sum to {bucket_tails * 1e3:.3f} ms per step (they overlap in "
                     "time: the union is the figure)")
        if not compared:
            text += f"; {NOT_COMPARED}"
        elif timers and pred is None:
            text += f"; {NO_TIME_MODEL}"
        rows.append(judged(f"overlap.exposed_{group}_comm_per_step", "rank", predicted=pred, measured=measured,
                           unit="s", tolerance=EXPOSED_TOL, abs_tolerance=STEP_EXPOSED_ABS_S, explanation=text,
                           rank=r.rank, stage=r.stage, source=source))
    return rows


def overlap_rows(cfg: RunConfig | None, r: RankEvidence, selection: StepSelection, traced: bool, *,
                 predicted_exposed: Mapping[tuple[str, int], float] | None = None,
                 predicted_per_step: Mapping[str, float] | None = None) -> list[Row]:
    """Timer rows of one rank: per bucket always, per group per step only when the rank has no trace (the trace's
    kernels are the better measurement of the same figure)."""
    steps, note = selection.timed({t.step for t in r.timing})
    intervals = timer_intervals(r)
    rows = bucket_rows(cfg, r, intervals, "timers", steps=steps, note=note,
                       judged_elsewhere="the trace row (source trace)" if traced else None,
                       predicted_exposed=predicted_exposed)
    if not traced:
        rows += exposed_comm_rows(r, timer_exposed(r, steps), "timers", note=note,
                                  bucket_tails=_bucket_tails(intervals, steps), predicted=predicted_per_step)
    return rows + cp_exchange_row(cfg, r, steps, note)


def trace_overlap_rows(cfg: RunConfig | None, r: RankEvidence, summary: TraceSummary,
                       groups: dict[str, tuple[int, ...]], selection: StepSelection, *,
                       predicted_exposed: Mapping[tuple[str, int], float] | None = None,
                       predicted_per_step: Mapping[str, float] | None = None) -> list[Row]:
    """Trace rows of one rank: per bucket (NCCL kernels on the DP group) and per group per step."""
    steps = trace_steps(summary, r, selection)
    intervals = trace_intervals(summary, r, groups["dp"], cfg)
    rows = bucket_rows(cfg, r, intervals, "trace", steps=steps, predicted_exposed=predicted_exposed)
    rows += exposed_comm_rows(r, trace_exposed(summary, groups, steps, p2p_group(cfg)), "trace",
                              bucket_tails=_bucket_tails(intervals, steps), predicted=predicted_per_step)
    return rows


def cp_exchange_row(cfg: RunConfig | None, r: RankEvidence, steps: list[int], note: str = "") -> list[Row]:
    """overlap.cp_exchange.hidden_fraction of one rank (module docstring): the exchanges' time during compute over
    their whole time, summed over `steps`, against cp_prediction; no row without ring exchanges in those steps."""
    by_step = _by_step(r.timing)
    hidden = total = 0.0
    exchanges = 0
    for step in steps:
        records = by_step.get(step, [])
        busy = timer_compute(records)
        for t in records:
            if t.category == "cp-comm":
                span = (t.start_s, t.end_s)
                hidden, total, exchanges = hidden + covered(span, busy), total + length([span]), exchanges + 1
    if not exchanges:
        return []
    predicted, how = cp_prediction(cfg, r)
    text = (f"share of the ring attention exchanges' time (issue -> wait returned) during compute, {exchanges} "
            f"exchanges in {step_list(steps)} (timers)" + (f"; {note}" if note else "") + "; the rest "
            f"is the cp-wait stalls; {how}; an exchange is a rendezvous, so a wait also holds the time until the "
            "neighbouring CP ranks reach the same ring step (skew between them shows here)")
    return [row("overlap.cp_exchange.hidden_fraction", "rank", predicted=predicted,
                measured=hidden / total if total > 0 else 0.0, unit="fraction", tolerance=FRACTION_TOL,
                explanation=text, rank=r.rank, stage=r.stage, source="timers")]


def attention_rate(cfg: RunConfig, records: list[ComputeRecord], op: str, causal: bool) -> float | None:
    """Seconds per FLOP of the compute sweep's `op` (core_attention.fwd / .bwd) at this rank's dtype, micro-batch
    and TP-local heads, for the ring block of that kind (the sweep times the causal diagonal and the unmasked half
    block apart: dims `causal`), slowed by the sweep's sustained factor as the time model slows attention; the rate
    scales to the block by its FLOPs. A sweep without ring blocks (made before them) gives the swept sequence nearest
    s/C. None without such a record."""
    m, t = cfg.model, cfg.parallel.tensor_model_parallel_size
    want = dict(batch=cfg.train.micro_batch_size, heads=m.num_attention_heads // t,
                kv_heads=m.num_query_groups // t, head_dim=m.head_dim)
    found = [x for x in records if x.op == op and x.dtype == cfg.train.params_dtype
             and x.flops and x.seconds and (x.dims or {}).get("seq")
             and all(x.dims.get(k) == v for k, v in want.items())]
    blocks = [x for x in found if x.dims.get("causal") == int(causal)]
    if not found:
        return None
    nearest = min(blocks or found, key=lambda x: abs(math.log(x.dims["seq"] / local_seq_length(cfg))))
    return float(nearest.seconds) / float(nearest.flops) * Calibration.from_records(records, []).sustained


def cp_prediction(cfg: RunConfig | None, r: RankEvidence) -> tuple[float | None, str]:
    """(predicted hidden fraction, how) from the config and this rank's own calibration (ledger.models.formulas.
    ring_overlap): each message's time from the bandwidth sweep's send_recv on the cp group at its size, each
    block's from the compute sweep's attention rate; None, saying what is missing, without them."""
    if cfg is None or cfg.parallel.context_parallel_size == 1:
        return None, "no prediction: no CP config"
    rates = {}
    for phase, op in ((FORWARD, "core_attention.fwd"), (BACKWARD, "core_attention.bwd")):
        for causal in (True, False):
            rate = attention_rate(cfg, r.compute, op, causal)
            if rate is None:
                return None, (f"no prediction: the compute sweep (--compute-sweep) has no {op} record at this "
                              "rank's heads and dtype to price the blocks")
            rates[phase, causal] = rate
    exchanges = ring_exchanges(cfg, r.stage)
    transfers = {e.message_bytes: predicted_time(r.bandwidth, normalize_op("send_recv"), "cp", e.message_bytes)
                 for e in exchanges}
    if any(found is None for found in transfers.values()):
        return None, "no prediction: the bandwidth sweep (--bandwidth-sweep) has no send_recv on the cp group"
    fraction = hidden_fraction(exchanges, lambda nbytes: transfers[nbytes][0], rates)
    parts = dict.fromkeys(f"{e.phase}, {e.message_bytes:,} B: {'causal' if e.causal else 'half'} block "
                          f"{e.block_flops * rates[e.phase, e.causal] * 1e6:.3g} us "
                          f"beside a {transfers[e.message_bytes][0] * 1e6:.3g} us transfer" for e in exchanges)
    sweeps = "; ".join(sorted({how for _, how in transfers.values()}))
    return fraction, ("predicted: each exchange hides min(1, block / transfer), byte-weighted over the step "
                      f"(ledger/models/formulas/ring_overlap.py): {', '.join(parts)} "
                      "(each block at the compute sweep's "
                      f"rate for its kind, scaled by FLOPs; {sweeps})")


def _bucket_tails(intervals: list[BucketInterval], steps: list[int]) -> float | None:
    kept = [i for i in intervals if i.step in steps]
    return sum(i.exposed for i in kept) / len(steps) if kept else None


def _expected_fraction(op: str, last: bool, cfg: RunConfig | None) -> float | None:
    """Structural expectation from the config: without overlap nothing hides (the collective runs after backward, or
    in the optimizer step); with it every bucket hides but the one with nothing to hide behind (no prediction)."""
    if cfg is None:
        return None
    overlap = cfg.train.overlap_param_gather if op == "all_gather" else cfg.train.overlap_grad_reduce
    if not overlap:
        return 0.0
    return None if last else 1.0


def _why(op: str, last: bool, cfg: RunConfig | None) -> str:
    if cfg is None:
        return "no config: no expectation"
    if op == "all_gather":
        if not cfg.train.overlap_param_gather:
            return "without --overlap-param-gather the all-gathers run in the optimizer step: no overlap expected"
        if last:
            return ("the first layers' bucket is gathered first: issued at the end of the optimizer step and waited "
                    "for by the first layer's pre-hook, it has no forward to hide behind (no prediction)")
        return "--overlap-param-gather hides each all-gather behind the forward of the layers before it"
    if not cfg.train.overlap_grad_reduce:
        return "without --overlap-grad-reduce grads are reduced after backward: no overlap expected"
    if last:
        return "the last bucket issued has no backward left to hide behind (no prediction)"
    return "--overlap-grad-reduce issues buckets during backward"
