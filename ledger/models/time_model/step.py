"""The step replayed on a global clock: predicted step time, per-stage bubble, exposed communication per group and
per DP bucket, from the run's config and the machine's calibration only.

Order of work, as the engine runs a step (docs/engine.md):
1. each stage clears its grad buffers (`grad_buffer.zero`, per element) and, under --overlap-param-gather, issues
   its first param all-gather;
2. the schedule (ledger/models/schedule.py: no pipelining, 1F1B or interleaved, the engine's exact order) runs every
   stage's forwards and backwards, each item lasting its chunk's forward or backward time (compute.py), plus, on
   the first forward of a chunk, the waits for its param all-gathers (buckets.gather_chain), and, for an item that
   sends to another stage, one P2P transfer (the sender's exchange holds it, and the receiver has the tensor when
   the item ends);
3. DP grad collectives are issued at their points (buckets.py) and run on their own stream; finalize_model_grads
   waits for them, then all-reduces the SP norm grads over TP and, tied under PP > 1, the embedding grads;
4. the optimizer starts once every stage is there (its grad norm is all-reduced over the model-parallel group and,
   under the distributed optimizer, over DP: a 4-byte all-reduce): per element of the rank's main params
   (`optimizer.step`), then, without --overlap-param-gather, the synchronous all-gather of every bucket; the loss's
   4-byte all-reduce over DP ends the step.
Context parallelism (C > 1): the chunks' passes are at s/C tokens with the ring attention's exposed messages inside
them (ops.py, compute.py; `exposed["cp"]` per step), the P2P messages between stages are s/C tokens, and every DP
collective (grad buckets, param all-gathers, the 4-byte loss and grad-norm all-reduces) runs over Megatron's dp_cp
group of dp x C ranks (ledger/models/formulas/buffer_layout.py dp_cp_size; the link priced is the `dp_cp` group's).
Mixture of experts: the chunks' passes hold the MoE layers' ops and all-to-alls (ops.py); the grad-buffer memset and
the optimizer step run over the expert buffers too (their elements sharded over the expert-data-parallel group under
the distributed optimizer); the expert buffers' own grad reduction and param all-gather over that group are not
replayed (a note says so where the group has more than one rank); `exposed["ep"]` is the all-to-alls' time a step.
The pipeline bubble is the measurement's convention (ledger/reconcile/pipeline.py): 1 - a stage's forward/backward
time over the span from the first forward to the last backward of the pipeline; the same replay with P2P transfers
and param all-gather waits at zero attributes its gap to the textbook (p-1)/(vm+p-1) to stage imbalance or comm.

With host costs in the calibration (host.py, docs/formulas.md "Host timeline") each item lasts its range's span on
the device as the host paces it, the step starts with the time before the first range and ends with the optimizer's
and the loss's reads; the step decomposition's predicted terms come from the same timelines.

Not modelled: contention between an overlapped collective and the compute beside it (both run at their standalone
speeds, so a prediction of overlapped comm is a lower bound of its slowdown); a send waiting for its receiver to post
(the exchange is priced as one transfer); under PP, a stage's host waiting for another stage (each stage's pace is
its own host timeline's, then the schedule replays the pipeline).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Iterable

from common.config import RunConfig
from common.intervals import Interval, union
from common.ops import Shapes
from common.ops.compute_class import ATTENTION, CLASSES, MATMUL, OPTIMIZER, OTHER
from common.ops.rank import optimizer_rate
from ledger.models.formulas.activations import local_seq_length
from ledger.models.formulas.buffer_layout import (
    BufferLayout,
    dp_cp_size,
    expert_dp_size,
    expert_rank_buffers,
    rank_buffers,
    shard_param_elements,
)
from ledger.models.formulas.bytes_per_param import DTYPE_BYTES
from ledger.models.formulas.comm import grad_group
from ledger.models.formulas.flops import tokens_per_step
from ledger.models.formulas.params import (
    chunk_tensors,
    embedding_copy_on_last_stage,
    num_chunks,
)
from ledger.models.schedule import BACKWARD, FORWARD, Item, Timeline, simulate, stage_order
from ledger.models.time_model import buckets
from ledger.models.time_model.calibration import Calibration
from ledger.models.time_model.compute import StageTime, class_seconds, stage_time
from ledger.models.time_model.host import StageHost, StageWork, decomposition, stage_host
from ledger.models.time_model.ops import delayed_expert_wgrad
from ledger.models.time_model.prediction import StagePrediction, StepPrediction

POWER_ROUNDS, POWER_SETTLED = 4, 1e-3  # the power-limit factor's fixed point: rounds at most, change that ends it
CONTENTION = "overlapped comm and compute each at standalone speed (contention not modelled)"
EXPERT_DP = ("MoE: the expert buffers' grad reduction and param all-gather over the expert-data-parallel group are "
             "not priced (their memset and optimizer update are)")
NEW_ROWS = ("SequentialMLP: every micro-batch routed uniformly, T k / E rows an expert; a routed run meets row counts "
            "new to the process, each GEMM at one 0.12-0.2 ms more on the host (cuBLAS's kernel choice; "
            "BENCHMARKS.md, 2026-12-05 sixth), not priced: --moe-grouped-gemm or --moe-pad-expert-rows avoid them")


def sequential_routed_rows(cfg: RunConfig) -> bool:
    """SequentialMLP experts at routed row counts: an MoE model without grouped GEMMs or padded rows (padding to a
    multiple of 16 or more leaves few counts to meet)."""
    return cfg.model.is_moe and not cfg.model.moe_grouped_gemm and (cfg.model.moe_pad_expert_rows or 1) < 16


def _optimizer_elements(layouts: list[BufferLayout], dp: int, distributed: bool) -> int:
    """Main-param elements of the rank's update over these buffers: its shard (the largest over the dp ranks that
    shard them) under the distributed optimizer, else all of them."""
    if distributed:
        return max(sum(shard_param_elements(layout, dp, r) for layout in layouts) for r in range(dp))
    return sum(layout.numel_unpadded for layout in layouts)


def _sends(p: int, v: int, stage: int, item: Item) -> bool:
    vstage = item.chunk * p + stage
    return p > 1 and (vstage < p * v - 1 if item.kind == FORWARD else vstage > 0)


@dataclass
class _Stage:
    """What the replay needs of one stage: its chunks' times, buffers and per-step one-offs."""
    times: StageTime
    layouts: list
    memset: float
    optimizer: float
    delayed_wgrad: float  # --moe-delay-expert-wgrad: the experts' wgrads after the last backward (0 without)
    gather_seconds: list[list[float]]  # per chunk, per bucket
    grad_seconds: list[list[float]]
    grad_bytes: list[list[int]]
    param_bytes: list[list[int]]
    work: StageWork  # the one-offs as the host timeline takes them


class _Replay:
    def __init__(self, cfg: RunConfig, cal: Calibration):
        self.cfg, self.cal = cfg, cal
        par, train = cfg.parallel, cfg.train
        self.p, self.v, self.m = par.pipeline_model_parallel_size, num_chunks(cfg), cfg.num_microbatches
        self.dp, self.tp = dp_cp_size(cfg), par.tensor_model_parallel_size
        self.dp_group = grad_group(cfg)
        act = DTYPE_BYTES[train.params_dtype]
        message = act * local_seq_length(cfg) * train.micro_batch_size * cfg.model.hidden_size
        message //= self.tp if par.sequence_parallel else 1
        self.transfer = cal.comm.seconds("pp", "send_recv", self.p, message) if self.p > 1 else 0.0
        self.gathering = train.use_distributed_optimizer and self.dp > 1
        self.stages = [self._stage(s) for s in range(self.p)]
        self.host = [self.stage_host(s) for s in range(self.p)] if cal.host is not None else None

    def stage_host(self, s: int, profiled: bool = False, window: bool = False) -> StageHost:
        """Stage s's step on the host's and the device's clocks, alone (host.py)."""
        return stage_host(self.cfg, self.cal, self.cal.host, s, self.stages[s].work,
                          stage_order(self.p, s, self.m, self.v), profiled, window)

    def flush_in_tail(self, s: int) -> float:
        """Stage s's delayed wgrads where the host timeline runs them as the start of its tail (host.py) rather than
        as the end of grads_done: all of them under it, none on the device's clock alone."""
        return self.stages[s].delayed_wgrad if self.host is not None else 0.0

    def memset_end(self, s: int) -> float:
        """When stage s's grad-buffer memset ends on the replay's clock: under the host timeline it runs before the
        first range opens (in the step's lead), so never after the clock's 0."""
        return self.stages[s].memset if self.host is None else 0.0

    def _stage(self, s: int) -> _Stage:
        cfg, train, dp, group = self.cfg, self.cfg.train, self.dp, self.dp_group
        layouts = rank_buffers(cfg, s)
        gbytes, pbytes = DTYPE_BYTES[train.grad_dtype], DTYPE_BYTES[train.params_dtype]
        grad_op = "reduce_scatter" if train.use_distributed_optimizer else "all_reduce"
        sizes = [[end - start for start, end in layout.buckets] for layout in layouts]
        experts = expert_rank_buffers(cfg, s)
        elements = _optimizer_elements(layouts, dp, train.use_distributed_optimizer)
        elements += _optimizer_elements(experts, expert_dp_size(cfg), train.use_distributed_optimizer)
        grad_bytes = [[n * gbytes for n in chunk] for chunk in sizes]
        param_bytes = [[n * pbytes for n in chunk] for chunk in sizes]
        memset = self.cal.rate_seconds("grad_buffer.zero", train.grad_dtype,
                                       sum(lay.numel for lay in layouts + experts))
        optimizer = self.cal.rate_seconds(optimizer_rate(Shapes.of(cfg)).name, train.params_dtype, elements)
        flush = delayed_expert_wgrad(cfg, s)
        flush_classes = class_seconds(flush, cfg, self.cal)
        if flush and self.cal.power is not None and self.cal.power.threshold_share is not None:
            # the flush's GEMMs back to back are a phase of their own, at the factor of their own share, as the
            # sweep's loop is (docs/formulas.md, "The power limit in a step")
            flush_classes = class_seconds(flush, cfg, replace(self.cal, sustained=self.cal.power.factor(
                compute_bound_part(flush_classes))))
        delayed = sum(seconds for _, seconds, _ in flush_classes)
        return _Stage(
            times=stage_time(cfg, self.cal, s), layouts=layouts, memset=memset, optimizer=optimizer,
            delayed_wgrad=delayed,
            gather_seconds=[[self.cal.comm.seconds(group, "all_gather", dp, b) for b in chunk]
                            for chunk in param_bytes] if self.gathering else [[] for _ in sizes],
            grad_seconds=[[self.cal.comm.seconds(group, grad_op, dp, b) for b in chunk] for chunk in grad_bytes],
            grad_bytes=grad_bytes, param_bytes=param_bytes,
            work=StageWork(memset=memset, update=optimizer, buffers=len(layouts + experts),
                           tensors=sum(len(lay.param_ranges) for lay in layouts + experts), elements=elements,
                           delayed_wgrad=delayed, delayed_weights=len(flush),
                           delayed_classes=flush_classes))

    # --- the schedule, with the first forwards' stalls found by iterating to a fixed point ---------------------
    def base(self, s: int, item: Item) -> float:
        """The item's range on the device: its device time, or, under the host timeline, its span as the host paces
        it."""
        return self.device(s, item) if self.host is None else self.host[s].items[item]

    def mean_range(self, s: int, kind: str) -> float:
        """A forward (or backward) range of stage s, mean over its micro-batches and chunks."""
        items = [i for i in stage_order(self.p, s, self.m, self.v) if i.kind == kind]
        return sum(self.base(s, i) for i in items) / len(items)

    def host_ranges(self, s: int) -> dict[str, float]:
        """Stage s's forward and backward ranges on the host's clock, each kind's mean over its items."""
        if self.host is None:
            return {}
        spans = self.host[s].host_items
        return {kind: sum(t for i, t in spans.items() if i.kind == kind) / sum(1 for i in spans if i.kind == kind)
                for kind in (FORWARD, BACKWARD)}

    def device(self, s: int, item: Item) -> float:
        t = self.stages[s].times.chunks[item.chunk]
        return t.forward.seconds if item.kind == FORWARD else t.backward.seconds

    def timeline(self, prefix: dict[tuple[int, Item], float], transfer: float) -> Timeline:
        def duration(s: int, item: Item) -> float:
            return prefix.get((s, item), 0.0) + self.base(s, item) + (transfer if _sends(self.p, self.v, s, item)
                                                                       else 0.0)
        return simulate(self.p, self.m, self.v, duration)

    def stalls(self, tl: Timeline, with_comm: bool) -> tuple[dict[tuple[int, Item], float], dict]:
        """Per first forward of a chunk: the memset still running when it could start, then its gather waits."""
        prefix: dict[tuple[int, Item], float] = {}
        gathers: dict[tuple[int, int], buckets.Gathers] = {}
        for s, st in enumerate(self.stages):
            start = {item: begin for begin, _, item in tl.stages[s]}
            free_at = 0.0
            for c in range(self.v):
                first = Item(FORWARD, 0, c)
                stall = max(0.0, self.memset_end(s) - start[first]) if c == 0 else 0.0
                begin = start[first] + stall
                if with_comm and self.cfg.train.overlap_param_gather and self.gathering:
                    # zero_grad issues chunk 0's; chunk c - 1's first forward, never before zero_grad, chunk c's
                    memset = self.memset_end(s)
                    issue = max(memset, start[Item(FORWARD, 0, c - 1)]) if c else memset
                    layout = st.layouts[c]
                    offsets = buckets.first_use_offsets(layout, st.times.chunks[c].forward.marks)
                    order = sorted(range(len(layout.buckets)), reverse=True)  # the last bucket holds the first layers
                    g = buckets.gather_chain(begin, issue, [offsets[b] for b in order],
                                             [st.gather_seconds[c][b] for b in order],
                                             chained=self.v == 1 and c == 0, free_at=free_at)
                    free_at = g.intervals[-1][1] if g.intervals else free_at
                    gathers[(s, c)] = g
                    stall += g.total_wait
                prefix[(s, first)] = stall
        return prefix, gathers

    def settle(self, with_comm: bool) -> tuple[Timeline, dict[tuple[int, Item], float], dict]:
        transfer = self.transfer if with_comm else 0.0
        prefix: dict[tuple[int, Item], float] = {}
        for _ in range(2 * self.p * self.v + 2):
            tl = self.timeline(prefix, transfer)
            new, gathers = self.stalls(tl, with_comm)
            if all(abs(new.get(k, 0.0) - prefix.get(k, 0.0)) < 1e-12 for k in set(new) | set(prefix)):
                return tl, new, gathers
            prefix = new
        return self.timeline(prefix, transfer), prefix, gathers

    # --- per stage figures --------------------------------------------------------------------------------------
    def compute_spans(self, tl: Timeline, prefix: dict) -> list[list[Interval]]:
        return [[(begin + prefix.get((s, item), 0.0), begin + prefix.get((s, item), 0.0) + self.base(s, item))
                 for begin, _, item in tl.stages[s]] for s in range(self.p)]

    def grad_issues(self, s: int, tl: Timeline, prefix: dict) -> list[tuple[int, int, float]]:
        """(chunk, bucket, issue time) of every grad collective of stage s, in issue order."""
        train, st = self.cfg.train, self.stages[s]
        spans = tl.stages[s]
        end = spans[-1][1] + st.delayed_wgrad  # the buckets are reduced once the delayed wgrads are in
        nbuckets = [len(layout.buckets) for layout in st.layouts]
        if not train.overlap_grad_reduce:
            return [(c, b, end) for c in range(self.v) for b in range(nbuckets[c])]
        backwards = [(begin + prefix.get((s, item), 0.0), item) for begin, _, item in spans if item.kind == BACKWARD]
        if self.v == 1:
            if self.p > 1 and s > 0:
                return [(0, b, end) for b in range(nbuckets[0])]
            start = backwards[-1][0]
            ready = buckets.ready_offsets(st.layouts[0], st.times.chunks[0].backward.marks)
            return sorted(((0, b, start + r) for b, r in enumerate(ready)), key=lambda x: x[2])
        out = []
        for j, (_, item) in enumerate(backwards):
            if item.microbatch != self.m - 1:
                continue
            k = j + s
            issue = (backwards[k][0] + self.base(s, backwards[k][1])) if k < len(backwards) else end
            out += [(item.chunk, b, issue) for b in range(nbuckets[item.chunk])]
        return sorted(out, key=lambda x: x[2])

    def stage_collectives(self, s: int) -> tuple[float, float]:
        """(SP norm-grad all-reduce over TP, tied-embedding grad all-reduce) of stage s in finalize_model_grads."""
        cfg, train = self.cfg, self.cfg.train
        gbytes = DTYPE_BYTES[train.grad_dtype]
        tensors = [t for c in range(self.v) for t in chunk_tensors(cfg, s, c)]
        sp = 0.0
        if cfg.parallel.sequence_parallel:
            norms = sum(t.numel for t in tensors if t.sequence_parallel)  # norms, row-parallel biases
            sp = self.cal.comm.seconds("tp", "all_reduce", self.tp, norms * gbytes)
        shared = [t for t in tensors if t.shared_embedding]
        embedding = (self.cal.comm.seconds("embedding", "all_reduce", 2, shared[0].numel * gbytes)
                     if embedding_copy_on_last_stage(cfg) and shared else 0.0)
        return sp, embedding


@dataclass(frozen=True)
class _Figures:
    """One stage's step on the replay's clock."""
    busy: float  # its ranges' spans (the timers' measure)
    device: float  # of them, the device's own time (busy less the host-bound idle inside the ranges)
    busy_union: list[Interval]
    last_end: float  # its last item, P2P exchange included
    grads_done: float
    waits: float  # param all-gather waits before its first forwards
    sends: float
    sp: float
    embedding: float
    dp_exposed: float
    buckets: list[buckets.BucketComm]


def _figures(r: _Replay, s: int, tl: Timeline, prefix: dict, gathers: dict, compute: list[Interval]) -> _Figures:
    st, train = r.stages[s], r.cfg.train
    busy_union = union(compute)
    grad_op = "reduce_scatter" if train.use_distributed_optimizer else "all_reduce"
    mine = {c: g for (gs, c), g in gathers.items() if gs == s}
    comms, intervals = [], []
    for c, g in sorted(mine.items()):
        order = sorted(range(len(st.layouts[c].buckets)), reverse=True)  # forward order: the last bucket first
        for b, issue, (begin, end), wait in zip(order, g.issues, g.intervals, g.waits):
            comms.append(buckets.BucketComm(s, c, b, "all_gather", st.param_bytes[c][b], issue, begin, end, wait))
            intervals.append((begin, end))
    issues = r.grad_issues(s, tl, prefix) if r.dp > 1 else []
    free_at = max((end for _, end in intervals), default=0.0)
    runs = buckets.serial([(t, st.grad_seconds[c][b]) for c, b, t in issues], free_at)
    for (c, b, issue), (begin, end) in zip(issues, runs):
        comms.append(buckets.BucketComm(s, c, b, grad_op, st.grad_bytes[c][b], issue, begin, end,
                                        buckets.exposed([(begin, end)], busy_union)))
    last_end = tl.stages[s][-1][1]
    sp, embedding = r.stage_collectives(s)
    ready = max([last_end + st.delayed_wgrad] + [e for _, e in runs]) - r.flush_in_tail(s)
    return _Figures(busy=sum(e - b for b, e in compute), device=sum(r.device(s, item) for _, _, item in tl.stages[s]),
                    busy_union=busy_union, last_end=last_end,
                    grads_done=ready + sp + embedding,
                    waits=sum(g.total_wait for g in mine.values()),
                    sends=r.transfer * sum(1 for _, _, item in tl.stages[s] if _sends(r.p, r.v, s, item)),
                    sp=sp, embedding=embedding, dp_exposed=buckets.exposed(intervals + runs, busy_union),
                    buckets=comms)


def _span(compute: list[list[Interval]], tl: Timeline, r: _Replay) -> float:
    """From the first forward range's start (after the memset stall, before any gather wait) to the last backward's
    end, over the pipeline: the measurement's span."""
    starts = [tl.stages[s][0][0] + max(0.0, r.memset_end(s) - tl.stages[s][0][0]) for s in range(r.p)]
    return max(e for spans in compute for _, e in spans) - min(starts)


def _terms(r: _Replay, tl: Timeline, f: _Figures, s: int, tail: float, loss: float, lead: float,
           step_time: float) -> dict[str, float]:
    """The critical stage's step, term by term; the last term is whatever it waits for the other stages."""
    memset = max(0.0, r.memset_end(s) - tl.stages[s][0][0])
    delayed, in_tail = r.stages[s].delayed_wgrad, r.flush_in_tail(s)
    terms = {"grad buffer memset": memset, "forward/backward compute": f.device, "param all-gather waits": f.waits,
             "P2P transfers": f.sends, "pipeline bubble": f.last_end - f.busy - f.waits - f.sends - memset,
             "delayed expert weight gradients": delayed,
             "DP grad reduction tail": f.grads_done - f.sp - f.embedding - f.last_end - (delayed - in_tail),
             "SP norm-grad all-reduce": f.sp, "embedding grad all-reduce": f.embedding, "optimizer": tail - in_tail,
             "loss all-reduce": loss}
    if r.host is not None:
        # the host's tail is the optimizer range, its grad-norm read and the loss's read
        terms |= {"step start (zero_grad, first issues)": lead, "host-bound idle in the passes": f.busy - f.device}
    terms["waiting for the other stages"] = step_time - sum(terms.values())
    return terms


def _window(r: _Replay, s: int) -> Timeline:
    """Stage s's host timeline up to a profiler window's end, under the profiled host costs where measured."""
    return r.stage_host(s, r.cal.host.has_profiled, window=True).timeline


def _decomposition(tl: Timeline, f: _Figures, wait: float) -> dict[str, float]:
    """A stage's predicted decomposition: its window's timeline with the replay's dp, pp and embedding exposure and
    its wait for the other stages."""
    return decomposition(tl, {"dp": f.dp_exposed, "pp": f.sends, "embedding": f.embedding}, wait)


def _device_compute(r: _Replay, s: int) -> dict[str, float]:
    """Stage s's device work in a step by compute class: every pass's kernels (its entries less the collectives on
    the compute stream) per micro-batch, the delayed wgrads, the memset (other kernels) and the update."""
    st = r.stages[s]
    by_class: dict[str, float] = dict.fromkeys(CLASSES, 0.0)
    for pt in (pt for t in st.times.chunks for pt in (t.forward, t.backward)):
        for cls, seconds in pt.by_class.items():
            by_class[cls] += r.m * seconds
    for cls, seconds, _ in st.work.delayed_classes:
        by_class[cls] += seconds
    by_class[OTHER] += st.memset
    by_class[OPTIMIZER] += st.optimizer
    return by_class


def predict_step(cfg: RunConfig, cal: Calibration) -> StepPrediction:
    """The step of `cfg` on the machine `cal` describes. Raises CalibrationMissing when a figure it needs is not
    calibrated (no compute sweep, no bandwidth sweep of a group the layout uses). Where the calibration knows the
    power limit's threshold (PowerLimit), the passes' kernels are slowed by the factor of the step's own
    compute-bound share (StepPrediction.power_share), found by fixed point from the full-load factor: the share moves
    little with the factor, so a few rounds settle it (docs/formulas.md, "The power limit in a step")."""
    step = _predict_at(cfg, cal)
    if cal.power is None or cal.power.threshold_share is None:
        return step
    for _ in range(POWER_ROUNDS):
        factor = cal.power.factor(step.power_share)
        if abs(factor - step.power_factor) < POWER_SETTLED:
            break
        step = _predict_at(cfg, replace(cal, sustained=factor))
    return step


def compute_bound_part(classes: Iterable[tuple[str, float, int]]) -> float:
    """The compute-bound (GEMM and attention) part of work's seconds by class."""
    total = sum(seconds for _, seconds, _ in classes)
    bound = sum(seconds for cls, seconds, _ in classes if cls in (MATMUL, ATTENTION))
    return bound / total if total > 0 else 0.0


def _power_share(r: _Replay, s: int, by_class: dict[str, float], step_time: float) -> float:
    """The share of the step's wall time stage s's compute-bound kernels (GEMMs, attention) fill, both without the
    delayed flush's phase."""
    flush = r.stages[s].work.delayed_classes
    bound = by_class[MATMUL] + by_class[ATTENTION] - sum(t for cls, t, _ in flush if cls in (MATMUL, ATTENTION))
    wall = step_time - r.stages[s].delayed_wgrad
    return bound / wall if wall > 0 else 0.0


def _predict_at(cfg: RunConfig, cal: Calibration) -> StepPrediction:
    """The step with the passes' kernels at `cal.sustained` their isolated times."""
    r = _Replay(cfg, cal)
    tl, prefix, gathers = r.settle(with_comm=True)
    tl_quiet, prefix_quiet, _ = r.settle(with_comm=False)
    compute, compute_quiet = r.compute_spans(tl, prefix), r.compute_spans(tl_quiet, prefix_quiet)
    span, span_quiet = _span(compute, tl, r), _span(compute_quiet, tl_quiet, r)
    figures = [_figures(r, s, tl, prefix, gathers, compute[s]) for s in range(r.p)]
    scalar = cal.comm.seconds(r.dp_group, "all_reduce", r.dp, 4)  # a loss or grad-norm all-reduce over DP (x CP)
    # The optimizer range: the grad norm all-reduce waits for every stage, then the update and, without
    # --overlap-param-gather, the gather of every bucket. Under the host timeline the update is the host's range
    # (its issues, the device's update, the grad-norm read) and the step's end follows it (the loss's read).
    extra = [cfg.train.use_distributed_optimizer * scalar
             + (sum(map(sum, st.gather_seconds)) if not cfg.train.overlap_param_gather else 0.0) for st in r.stages]
    ranges = [st.optimizer if r.host is None else r.host[s].optimizer for s, st in enumerate(r.stages)]
    tails = [x + (st.optimizer if r.host is None else r.host[s].tail) for s, (st, x) in enumerate(zip(r.stages, extra))]
    lead = max((h.lead for h in r.host), default=0.0) if r.host is not None else 0.0
    optimizer_start = max(f.grads_done for f in figures)
    step_time = lead + optimizer_start + max(tails) + scalar
    critical = max(range(r.p), key=lambda s: figures[s].grads_done)
    stages = tuple(StagePrediction(
        stage=s, compute=st.times, busy=f.busy, bubble=1 - f.busy / span if span else 0.0,
        bubble_without_comm=1 - sum(e - b for b, e in compute_quiet[s]) / span_quiet if span_quiet else 0.0,
        exposed={"dp": f.dp_exposed, "tp": r.m * sum(t.forward.comm + t.backward.comm for t in st.times.chunks)
                 + f.sp, "pp": f.sends, "embedding": f.embedding,
                 **({"cp": r.m * sum(t.forward.cp_exposed + t.backward.cp_exposed for t in st.times.chunks)}
                    if cfg.parallel.context_parallel_size > 1 else {}),
                 **({"ep": r.m * sum(t.forward.ep_comm + t.backward.ep_comm for t in st.times.chunks)}
                    if cfg.parallel.expert_model_parallel_size > 1 else {})},
        optimizer=optimizer_start - f.grads_done + rng + x, grads_done=f.grads_done,
        forward=r.mean_range(s, FORWARD), backward=r.mean_range(s, BACKWARD), delayed_wgrad=st.delayed_wgrad,
        host_ranges=r.host_ranges(s))
        for s, (st, f, rng, x) in enumerate(zip(r.stages, figures, ranges, extra)))
    terms = _terms(r, tl, figures[critical], critical, tails[critical], scalar, lead, step_time)
    waits = [_terms(r, tl, figures[s], s, tails[s], scalar, lead, step_time) for s in range(r.p)]
    device = {s: _device_compute(r, s) for s in range(r.p)}
    windows = {s: _window(r, s) for s in range(r.p)} if r.host is not None else {}
    decompositions = {s: _decomposition(tl_s, figures[s], waits[s]["pipeline bubble"]
                                        + waits[s]["waiting for the other stages"]) for s, tl_s in windows.items()}
    # the classes of the twin the step decomposition judges: the window's device compute (its gaps booked as
    # launch latency) under a host timeline, else the device's own work
    classes = {s: windows[s].compute_by_class if s in windows else device[s] for s in range(r.p)}
    return StepPrediction(step_time=step_time, tokens_per_s=tokens_per_step(cfg) / step_time, stages=stages,
                          buckets=tuple(b for f in figures for b in f.buckets), terms=terms,
                          critical_stage=critical, span=span,
                          notes=(CONTENTION,) + cal.notes
                          + ((EXPERT_DP,) if cfg.model.is_moe and expert_dp_size(cfg) > 1 else ())
                          + ((NEW_ROWS,) if sequential_routed_rows(cfg) else ()),
                          decompositions=decompositions,
                          decomposition_profiled=r.host is not None and cal.host.has_profiled,
                          device_compute_by_class=classes,
                          device_compute={s: sum(by_class.values()) for s, by_class in device.items()},
                          power_factor=cal.sustained,
                          power_share=_power_share(r, critical, device[critical], step_time))
