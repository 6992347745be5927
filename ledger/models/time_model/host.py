"""The host's side of the time model: one pipeline stage's step run on two clocks (stage_host). Every catalogue
entry costs host time to issue (host_recipe.py counts the primitives, HostCosts in host_costs.py prices them) and
device time to run (the compute sweep's); the device starts an entry no earlier than its issue; the step's reads
(the grad norm at the optimizer's end, an MoE layer's token counts, the loss) hold the host until the device has
drained. docs/formulas.md, "Host timeline".

What it gives the step's replay (step.py): each forward and backward range's span on the device (what the timers
measure) with the host pacing it, the time before the first range and after the last (zero_grad's memset and the
first issues; the optimizer and the reads), and the timeline whose busy, read and idle time are the step
decomposition's predicted terms, under the plain or the profiled host costs.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from common.config import RunConfig
from common.config.pipeline_layers import stage_num_layers
from common.ops import host as p
from common.ops.compute_class import OPTIMIZER, OTHER
from ledger.evidence.step_partition import (
    COMPUTE,
    DATA_WAIT,
    EXPOSED,
    HOST_BOUND,
    LAUNCH,
    PIPELINE_WAIT,
    SLOWER_RANK,
    SYNC,
)
from ledger.models.schedule import FORWARD, Item
from ledger.models.time_model import host_recipe as recipe
from ledger.models.time_model import megatron_host_recipe as megatron
from ledger.models.time_model.calibration import Calibration
from ledger.models.time_model.compute import class_seconds, entry_seconds
from ledger.models.time_model.host_costs import HostCosts
from ledger.models.time_model.host_timeline import Segment, Timeline, run
from ledger.models.time_model.ops import Collective, Work, chunk_blocks, chunk_ends


def decomposition(tl: Timeline, beside: dict[str, float], wait: float) -> dict[str, float]:
    """The step decomposition's terms (ledger.evidence.step_partition's names) of a window run on two clocks: the
    device's busy time on compute, the collectives on the compute stream (tp, cp, ep) and those `beside` it (the
    replay's dp, pp, embedding exposure) by group, the wait for other stages, the gaps between enqueued kernels and
    late launches' latency, the reads, and the host-bound rest."""
    terms = {COMPUTE: tl.busy.get("compute", 0.0) - tl.gaps}
    exposed = {g: tl.busy.get(g, 0.0) for g in ("tp", "cp", "ep")} | beside
    terms |= {f"{EXPOSED} {g}": t for g, t in exposed.items() if t > 0}
    return terms | {PIPELINE_WAIT: wait, SLOWER_RANK: 0.0, LAUNCH: tl.latency + tl.gaps, DATA_WAIT: 0.0,
                    SYNC: tl.reading, HOST_BOUND: tl.host_bound_idle}


@dataclass(frozen=True)
class StageWork:
    """A stage's per-step work beside its passes, as the replay prices it (step.py)."""
    memset: float  # zero_grad_buffer's device seconds
    update: float  # the optimizer step's device seconds
    buffers: int  # grad buffers (one memset each)
    tensors: int  # main params the optimizer loops over
    elements: int  # main-param elements it updates
    delayed_wgrad: float = 0.0  # --moe-delay-expert-wgrad: the experts' wgrads' device seconds after the last backward
    delayed_weights: int = 0  # the weights they are for (one GEMM each)
    delayed_classes: tuple[tuple[str, float, int], ...] = ()  # their seconds and entries by compute class


@dataclass(frozen=True)
class StageHost:
    """One stage's step on two clocks (its own items in its order, no wait for another stage)."""
    items: dict[Item, float]  # each range's span on the device
    host_items: dict[Item, float]  # each range's span on the host (its issue: what the timers' host times measure)
    lead: float  # step start to the first range's start on the device
    tail: float  # the last range's end to the step's end (optimizer, reads)
    optimizer: float  # the optimizer range's span on the device
    timeline: Timeline


def stage_host(cfg: RunConfig, cal: Calibration, host: HostCosts, stage: int, work: StageWork, order: list[Item],
               profiled: bool = False, window: bool = False) -> StageHost:
    """`stage`'s step in the order `order` of its items (the schedule's); `window`: up to the end of a profiler
    step's window, which also holds the probes' step end (the timers read back, the MoE routing counts)."""
    program = _Program(cfg, cal, host, stage, work, profiled, first=order[0])
    segments = program.step_start()
    for item in order:
        segments += program.item(item)
    segments += program.step_end() + (program.probes_end(order) if window else [])
    tl = run(segments, host.launch_latency, host.kernel_gap)
    first, last = order[0], order[-1]
    items = {item: tl.marks[f"end {item}"] - tl.marks[f"start {item}"] for item in order}
    host_items = {item: tl.host_marks[f"end {item}"] - tl.host_marks[f"start {item}"] for item in order}
    return StageHost(items=items, host_items=host_items, lead=tl.marks[f"start {first}"],
                     tail=tl.end - tl.marks[f"end {last}"],
                     optimizer=tl.marks["end optimizer"] - tl.marks["start optimizer"], timeline=tl)


class _Program:
    """The host's program of one stage's step as Segments, priced once per chunk and pass: this engine's calls, or
    Megatron-LM's (megatron_host_recipe.py) for a run of its local layers."""

    def __init__(self, cfg: RunConfig, cal: Calibration, host: HostCosts, stage: int, work: StageWork,
                 profiled: bool, first: Item | None = None):
        self.megatron = cfg.implementation.megatron
        self.code = megatron if self.megatron else recipe  # the recipes of the code the run ran
        if host.context is not None:  # set by whoever priced this host (a fit of it)
            forward = backward = host.context
        elif self.megatron:  # Megatron-LM's context calibrated on the host, else its recipes'
            forward = backward = host.megatron_context or self.code.CONTEXT
        elif host.engine_contexts is None:
            forward = backward = self.code.CONTEXT
        else:  # this engine's contexts calibrated on the host
            forward, backward = host.engine_contexts
        self.backward_host = replace(host, context=backward)
        host = replace(host, context=forward)
        self.cfg, self.cal, self.host, self.stage, self.work, self.profiled = cfg, cal, host, stage, work, profiled
        self.timers = cfg.probes.timers
        # Megatron-LM's --timing-log-level 2 timers call torch.cuda.synchronize() as they start and stop
        self.synchronising = cfg.implementation.timers_synchronise_passes
        self.counts_on_device = cfg.model.moe_grouped_gemm and cfg.parallel.expert_model_parallel_size == 1
        self.padded_experts = cfg.model.is_moe and (cfg.model.moe_pad_expert_rows or 1) > 1
        self.delayed_experts = cfg.model.is_moe and cfg.model.moe_delay_expert_wgrad
        self.graphed = cfg.implementation.graphed_layers
        self.first = first  # the step's first item: its forward follows the step end's waits for the device
        self._passes: dict[tuple[int, str, bool], tuple[list[Segment], float | None]] = {}

    def price(self, counts: recipe.Recipe, backward: bool = False) -> float:
        return (self.backward_host if backward else self.host).price(counts, self.profiled)

    def entry(self, w: Work, forward: bool) -> recipe.Recipe:
        """The primitives of one catalogue entry, as the run's code calls them."""
        return megatron.entry(w, forward) if self.megatron else recipe.entry(w, forward, self.counts_on_device,
                                                                          self.padded_experts, self.delayed_experts)

    def reads(self, counts: recipe.Recipe, device: float = 0.0, kind: str = "compute",
              scale: float | None = None, copy: tuple[str | None, str | None] = (None, None),
              classes: tuple[tuple[str, float, int], ...] = (), backward: bool = False) -> Segment:
        """A Segment of `counts`, its reads of the device (ITEM) after its issue; `scale`: the calls' plain seconds
        times it (a measured pass's context) instead of the recipes' CONTEXT (or the host's calibrated one, in a
        `backward` pass its backward's); `copy`: the counts' copy it starts and the one it waits for (counts_copy);
        `classes`: its device seconds by compute class."""
        counts = dict(counts)
        reads = counts.pop(p.ITEM, 0)
        issue = self.price(counts, backward) if scale is None else scale * self.host.plain(counts)
        return Segment(issue, device, kind, read=self.price({p.ITEM: reads}) if reads else None,
                       kernels=recipe.launched(counts) if kind == "compute" else 0, event=copy[0], wait=copy[1],
                       classes=classes if kind == "compute" else ())

    def counts_copy(self, w: Work, layer: int | None) -> tuple[str | None, str | None]:
        """(event, wait) of an entry of `layer`: with the counts on the device (--moe-grouped-gemm at EP 1) a layer's
        grouped fc1 fprop copies them to the host without waiting, and its backward waits for that copy with fc2's
        dgrad (the engine: once it has issued it, before the experts' wgrads; engine/transformer/moe/
        grouped_gemm_util.py HostCounts), or, with the wgrads delayed, the flush waits for every copy
        (delayed_wgrad). A re-run forward's copy (full recompute: no layer) is not followed: the wait is for the
        first forward's."""
        if not self.counts_on_device or layer is None:
            return None, None
        name = f"counts {layer}"
        waits = w.op.name == "experts.linear_fc2.dgrad" and not self.delayed_experts
        return name if w.op.name == "experts.linear_fc1.fprop" else None, name if waits else None

    def sync(self) -> Segment:
        return Segment(0.0, read=self.price({p.SYNC: 1}))

    def passes(self, chunk: int, kind: str, after_idle: bool = False) -> tuple[list[Segment], float | None]:
        """A chunk's pass as Segments, and its measured context (measured_context) where the sweep timed it;
        `after_idle`: the step's first forward, priced at the pass measured after the host slept."""
        key = (chunk, kind, after_idle)
        if key not in self._passes:
            forward = kind == FORWARD
            entries = []  # (the host's counts, the device's seconds, the device's kind, the counts' copy, classes)
            for block in chunk_blocks(self.cfg, self.stage, chunk, forward):
                if self.graphed and block.layer is not None:  # one replay for the layer's kernels
                    device = sum(entry_seconds(w, self.cfg, self.cal)[0] for w in block.work)
                    entries.append((recipe.graphed_layer(block.work, forward), device, "compute", (None, None),
                                    self.classes(block.work, forward)))
                    continue
                for w in block.work:
                    group = w.op.group if isinstance(w.op, Collective) else "compute"
                    entries.append((self.entry(w, forward), entry_seconds(w, self.cfg, self.cal)[0], group,
                                    self.counts_copy(w, block.layer), self.classes([w], forward)))
            scale = self.measured_context([counts for counts, _, _, _, _ in entries], forward, after_idle)
            self._passes[key] = ([self.reads(counts, device, group, scale, copy, classes, backward=not forward)
                                  for counts, device, group, copy, classes in entries], scale)
        return self._passes[key]

    def classes(self, work: list[Work], forward: bool) -> tuple[tuple[str, float, int], ...]:
        """The kernels of `work` by compute class: their seconds and launches."""
        return class_seconds(work, self.cfg, self.cal, lambda w: recipe.launched(self.entry(w, forward)))

    def measured_context(self, entries: list[recipe.Recipe], forward: bool, after_idle: bool = False) -> float | None:
        """The run's own measured pass (the host sweep's pass.forward: the model's call through the loss;
        pass.backward: torch.autograd.backward through it; pass.forward_after_idle, `after_idle`: the forward after
        the host slept, where the sweep has it) over its calls' plain prices: the context of this code on this
        host, measured; None for Megatron-LM's code or a sweep without the pass."""
        measured = self.host.measured(p.PASS_FORWARD_AFTER_IDLE, self.profiled) if after_idle and forward else None
        if measured is None:
            measured = self.host.measured(p.PASS_FORWARD if forward else p.PASS_BACKWARD, self.profiled)
        if measured is None or self.megatron:
            return None
        around = recipe.MODEL_CALL if forward else recipe.BACKWARD_START
        return measured / self.host.plain(recipe.sum_of(around, *entries))

    def range(self, name: str, work: list[Segment]) -> list[Segment]:
        """A probe range around `work`: its CUDA events are recorded as it opens and as it closes (marks); a
        synchronising timer waits for the device at both ends."""
        opening = self.price(recipe.probe_range(self.timers)) / 2
        sync = [self.sync()] if self.synchronising else []
        return [*sync, Segment(opening, mark=f"start {name}"), *work, Segment(opening, mark=f"end {name}"), *sync]

    def item(self, item: Item) -> list[Segment]:
        first, last = chunk_ends(self.cfg, self.stage, item.chunk)
        passes, scale = self.passes(item.chunk, item.kind, after_idle=item == self.first)
        if item.kind == FORWARD:
            counts = self.code.forward_start(first)
            if scale is not None:  # the model's calls are in the measured forward
                counts = {k: n - recipe.MODEL_CALL.get(k, 0) for k, n in counts.items()}
            start, end = Segment(self.price(counts)), self.loss(last)
        else:  # the backward call is part of a measured backward pass
            start, end = self.reads(self.code.BACKWARD_START, scale=scale, backward=True), []
        return self.range(str(item), [start, *passes, *end])

    def loss(self, last_stage: bool) -> list[Segment]:
        """After a forward's last entry: the loss on the last stage (Megatron-LM's with its NaN and Inf reads)."""
        if not self.megatron:
            return [Segment(self.price(recipe.forward_end(last_stage)))]
        if not last_stage:
            return []
        return [Segment(self.price(megatron.LOSS)), *map(self.reads, megatron.LOSS_CHECKS),
                Segment(self.price(megatron.LOSS_SCALE))]

    def step_start(self) -> list[Segment]:
        w = self.work
        counts = megatron.step_start(w.buffers, w.tensors) if self.megatron \
            else recipe.step_start(w.buffers, w.tensors, self.timers)
        kernels = recipe.launched(counts)
        return [Segment(self.price(counts), w.memset, kernels=kernels, classes=((OTHER, w.memset, kernels),))]

    def update(self, counts: recipe.Recipe, read: float) -> Segment:
        """The optimizer's step: its calls, the device's update, the grad norm's read."""
        kernels = recipe.launched(counts)
        return Segment(self.price(counts), self.work.update, read=read, kernels=kernels,
                       classes=((OPTIMIZER, self.work.update, kernels),))

    def step_end(self) -> list[Segment]:
        w, read = self.work, self.price({p.ITEM: 1})
        if self.megatron:
            update = self.update(megatron.optimizer(w.tensors, w.elements), read)
            syncs = [self.sync() for _ in range(megatron.OPTIMIZER_SYNCS if self.synchronising else 0)]
            return [*self.range("optimizer", [update]), *syncs, Segment(self.price(megatron.STEP_END)),
                    *(Segment(0.0, read=read) for _ in range(megatron.STEP_END_READS))]
        pipelined = self.cfg.parallel.pipeline_model_parallel_size > 1
        update = self.update(recipe.optimizer(w.tensors, w.elements), read)
        return [*self.delayed_wgrad(), *self.range("optimizer", [update]),
                Segment(self.price(recipe.step_end(pipelined)), read=read)]

    def delayed_wgrad(self) -> list[Segment]:
        """finalize_model_grads' delayed expert wgrads (--moe-delay-expert-wgrad), a probe range before the
        optimizer's."""
        w = self.work
        if not w.delayed_weights:
            return []
        copies = self.moe_layers() * self.cfg.num_microbatches if self.counts_on_device else 0
        counts = recipe.delayed_wgrad(w.delayed_weights, copies)
        return self.range("delayed wgrad", [Segment(self.price(counts), w.delayed_wgrad,
                                                     kernels=recipe.launched(counts), wait_all=bool(copies),
                                                     classes=w.delayed_classes)])

    def moe_layers(self) -> int:
        """The stage's MoE layers, over its chunks (every layer of an MoE model)."""
        if not self.cfg.model.is_moe:
            return 0
        return stage_num_layers(self.cfg.parallel, self.cfg.model.num_layers, self.stage)

    def probes_end(self, order: list[Item]) -> list[Segment]:
        """probes.step_end after the step: each timer range's two events waited for and read (the iteration, the
        optimizer, the items, each forward's data wait and the delayed wgrads' flush), each MoE layer's three
        routing counts read, then each range's record written."""
        forwards = sum(1 for item in order if item.kind == FORWARD)
        ranges = 2 + len(order) + forwards + (1 if self.work.delayed_weights else 0) if self.timers else 0
        reads = [self.sync() for _ in range(2 * ranges)]
        return reads + [Segment(0.0, read=self.price({p.ITEM: 1})) for _ in range(3 * self.moe_layers())] \
            + [Segment(ranges * self.host.record_write)]
