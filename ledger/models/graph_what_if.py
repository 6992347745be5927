"""What if, on a measured run's own execution graph: its profiled steps replayed (ledger.evidence.replay) with
kernels k times faster (all of them, or one compute class: the GEMMs, attention), communication k times faster, the
launch gaps gone (as CUDA graphs would have it), or the slowest rank's compute brought to the median rank's, beside
the replay of the steps as measured.

Each answer names what it changed, and per traced rank and profiled step gives the measured step (the ProfilerStep
window), the replayed baseline and the what-if. docs/formulas.md, "What if on the graph", says how each change is
made and what it leaves out; in short:
  * kernels: every GPU kernel but NCCL's takes 1/k of its measured time (copies and memsets do not change); on a CPU
    trace, the host time in compute ops (the step partition's device compute) does; GEMMs or attention: the same for
    the kernels (a CPU trace's compute ops) of that class (ledger.evidence.compute_classes);
  * communication: an NCCL kernel's transfer (after its last member arrived, where every member is traced; all of
    it otherwise) takes 1/k; on a CPU trace, the host time inside gloo ranges and c10d calls does;
  * no launch gaps: host time takes none, but for data waits and blocking syncs, so each GPU op starts when its
    stream and the work it waits for allow; the device latencies (launch, queue gap, sync wake-up) stay;
  * no straggler: per step, the traced rank with the most device compute has its GPU work in that step scaled so
    that its compute is the median rank's (GPU traces of two or more ranks, replayed together on one clock).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from statistics import median
from typing import Callable

from common.errors import ConfigError, InputError
from common.intervals import covered, length
from common.ops.compute_class import ATTENTION, MATMUL
from ledger.evidence.compute_classes import gpu_op_classes, host_op_classes
from ledger.evidence.exec_graph import CPU_OP, GLOO_PREFIX, ExecGraph, GpuOp, HostOp, cyclic_gc_paused, read_graph
from ledger.evidence.replay import Replay, measure_latencies, replay
from ledger.evidence.run import RunEvidence, span
from ledger.evidence.step_partition import NOT_COMPUTE, device_compute
from ledger.evidence.steps import profiler_cost, run_steps

COMPUTE, COMM, DATA_WAIT, OTHER = "compute", "comm", "data wait", "other"
COMM_RANGES = ("c10d::", GLOO_PREFIX)  # host ranges that communicate (gloo's collectives, the dispatcher's calls)
PROFILER_NOTE = 0.02  # a profiled step this much longer than a steady one gets the note (2%: beyond step-time noise)


@dataclass(frozen=True)
class Change:
    """The what-if: factors are speed-ups (2: twice as fast); 1 and False leave that part as measured. `matmul` and
    `attention` speed up one compute class (ledger.evidence.compute_classes) on top of `kernels`."""
    kernels: float = 1.0
    comm: float = 1.0
    no_launch_gaps: bool = False
    no_straggler: bool = False
    matmul: float = 1.0
    attention: float = 1.0

    def checked(self) -> Change:
        for name, k in (("kernels", self.kernels), ("communication", self.comm), ("GEMMs", self.matmul),
                        ("attention", self.attention)):
            if not (isinstance(k, (int, float)) and math.isfinite(k) and k > 0):
                raise ConfigError(f"{name} {k!r} times faster: a speed-up is a positive finite number")
        if (self.kernels, self.comm, self.no_launch_gaps, self.no_straggler, self.matmul, self.attention) == \
                (1.0, 1.0, False, False, 1.0, 1.0):
            raise ConfigError("nothing to change: make kernels, GEMMs, attention or communication faster, or take "
                              "away the launch gaps or the straggler")
        return self

    def class_factor(self, cls: str) -> float:
        """The speed-up of one compute class's kernels beyond `kernels`."""
        return {MATMUL: self.matmul, ATTENTION: self.attention}.get(cls, 1.0)


@dataclass(frozen=True)
class StepWhatIf:
    rank: int
    step: int
    measured: float  # s, the ProfilerStep window
    replayed: float  # s, the replay from the measured durations
    what_if: float  # s, the replay with the change

    @property
    def gain(self) -> float:
        """The what-if's step against the replayed one: -0.25 is a quarter shorter."""
        return (self.what_if - self.replayed) / self.replayed if self.replayed else 0.0


@dataclass
class WhatIfAnswer:
    change: Change
    ranks: list[int]
    together: bool  # the traced ranks replayed on one clock, their collectives matched
    changed: list[str]  # what the what-if changed, one sentence each
    steps: list[StepWhatIf]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        """The answer as `--json` prints it (seconds)."""
        return {"change": {"kernels_faster": self.change.kernels, "comm_faster": self.change.comm,
                           "no_launch_gaps": self.change.no_launch_gaps, "no_straggler": self.change.no_straggler,
                           "matmul_faster": self.change.matmul, "attention_faster": self.change.attention},
                "ranks": self.ranks, "replayed_together": self.together, "changed": self.changed, "notes": self.notes,
                "steps": [{"rank": s.rank, "step": s.step, "measured_s": s.measured, "replayed_s": s.replayed,
                           "what_if_s": s.what_if} for s in self.steps],
                "job": [{"step": n, "replayed_s": base, "what_if_s": changed}
                        for n, (base, changed) in sorted(self.job_steps().items())]}

    def job_steps(self) -> dict[int, tuple[float, float]]:
        """Per profiled step, the slowest rank's (replayed, what-if): a synchronous job steps at its slowest rank."""
        out: dict[int, tuple[float, float]] = {}
        for s in self.steps:
            base, changed = out.get(s.step, (0.0, 0.0))
            out[s.step] = (max(base, s.replayed), max(changed, s.what_if))
        return out


def what_if(ev: RunEvidence, change: Change) -> WhatIfAnswer:
    """Replay the run's traced steps as measured and with `change`; InputError for a run the change cannot apply to."""
    change = change.checked()
    if not ev.traces:
        raise InputError(ev.run_dir, "no profiler traces (--use-pytorch-profiler): a what-if replays the execution "
                                     "graph of the traced steps, and this run has none")
    with cyclic_gc_paused():
        graphs = [_graph(t.path, t.rank) for t in ev.traces]
        together = _one_clock(ev) and all(g.on_gpu for g in graphs)  # a CPU trace's collectives are not matched
        _check_applies(ev, change, graphs, together)
        host = {k: v for g in graphs for k, v in _host_classes(g).items()}  # by id(op), across the graphs
        compute = {k: v for g in graphs  # each GPU op's (a CPU trace: each host op's) compute class, by id(op)
                   for k, v in (gpu_op_classes(g) if g.on_gpu else host_op_classes(g)).items()}
        straggler, changed = _straggler_factors(graphs) if change.no_straggler else ({}, [])
        gpu_duration = _gpu_duration(change, straggler, compute)
        host_factor = _host_factor(change, host, compute, on_gpu=graphs[0].on_gpu)
        groups = [graphs] if together else [[g] for g in graphs]
        steps: list[StepWhatIf] = []
        for group in groups:
            base, new = replay(group), replay(group, gpu_duration=gpu_duration, host_factor=host_factor)
            steps += _steps(base, new)
    descriptions = _describe(change, graphs, host, compute, together) + changed
    return WhatIfAnswer(change, sorted({g.rank for g in graphs}), together, descriptions,
                        sorted(steps, key=lambda s: (s.step, s.rank)),
                        _notes(change, graphs, together) + _profiled_host(ev))


def _graph(path, rank: int) -> ExecGraph:
    graph = read_graph(path)
    if graph.rank is not None and graph.rank != rank:
        raise InputError(path, f"distributedInfo says rank {graph.rank}, the file name rank {rank}")
    graph.rank = rank
    return graph


def _one_clock(ev: RunEvidence) -> bool:
    """Whether the traces can be replayed together: one file per rank, more than one rank, all on one host."""
    ranks = [t.rank for t in ev.traces]
    hosts = {ev.host(r) for r in ranks}
    return len(ranks) > 1 and len(set(ranks)) == len(ranks) and len(hosts) == 1 and None not in hosts


def _check_applies(ev: RunEvidence, change: Change, graphs: list[ExecGraph], together: bool) -> None:
    cpu = [g.rank for g in graphs if not g.on_gpu]
    if change.no_launch_gaps and cpu:
        raise InputError(ev.run_dir, f"no launch gaps: the traces of rank(s) {span(cpu)} hold no GPU work (a CPU "
                                     "run), so there are no kernel launches whose gaps could go")
    if not change.no_straggler:
        return
    if len(graphs) < 2:
        raise InputError(ev.run_dir, f"no straggler: it compares the traced ranks, and this run traced rank "
                                     f"{graphs[0].rank} only (--profile-ranks)")
    if cpu:
        raise InputError(ev.run_dir, "no straggler: the replay does not match a CPU run's gloo collectives across "
                                     "ranks, so a straggler's effect on the others cannot be replayed")
    if not together:
        raise InputError(ev.run_dir, "no straggler: the traced ranks ran on more than one host (or the manifest does "
                                     "not say), and traces of different hosts do not share a clock to replay them on")


def _host_classes(g: ExecGraph) -> dict[int, str]:
    """Each host op's class by what encloses it: data wait, communication (gloo ranges, c10d calls; everything on a
    gloo worker thread), compute (a CPU op outside those and the stall ranges, as the step partition counts device
    compute on a CPU trace), or other."""
    waits = {id(op) for op in g.data_waits}
    out: dict[int, str] = {}
    for t in g.threads:
        stack: list[HostOp] = []
        for op in t.ops:
            while stack and stack[-1].end <= op.start:
                stack.pop()
            stack.append(op)
            if any(id(o) in waits for o in stack):
                out[id(op)] = DATA_WAIT
            elif t.comm_worker or any(o.name.startswith(COMM_RANGES) for o in stack):
                out[id(op)] = COMM
            elif op.kind == CPU_OP and not any(o.name.startswith(NOT_COMPUTE) for o in stack):
                out[id(op)] = COMPUTE
            else:
                out[id(op)] = OTHER
    return out


def _gpu_duration(change: Change, straggler: dict[int, float], compute: dict[int, str]) -> Callable[[GpuOp], float]:
    def duration(op: GpuOp) -> float:
        measured = op.end - op.start
        if op.collective is not None:
            return measured / change.comm
        speed_up = change.kernels * change.class_factor(compute.get(id(op), "")) if op.kind == "kernel" else 1.0
        return measured / speed_up * straggler.get(id(op), 1.0)
    return duration


def _host_factor(change: Change, classes: dict[int, str], compute: dict[int, str],
                 on_gpu: bool) -> Callable[[HostOp | None], float]:
    by_class = {COMPUTE: 1.0 if on_gpu else 1.0 / change.kernels, COMM: 1.0 if on_gpu else 1.0 / change.comm,
                DATA_WAIT: 1.0, OTHER: 1.0}
    if change.no_launch_gaps:
        by_class = {c: 1.0 if c == DATA_WAIT else 0.0 for c in by_class}

    def factor(op: HostOp | None) -> float:
        kind = classes.get(id(op), OTHER) if op is not None else OTHER
        if kind == COMPUTE and not on_gpu:  # a CPU trace's compute ops: their class's speed-up too
            return by_class[kind] / change.class_factor(compute.get(id(op), ""))
        return by_class[kind]
    return factor


def _straggler_factors(graphs: list[ExecGraph]) -> tuple[dict[int, float], list[str]]:
    """Per step every rank traced: the rank with the most device compute in its window; the factor on its GPU work
    launched in that window that makes its compute the median rank's; and a sentence per step saying so."""
    busy = {g.rank: device_compute(g) for g in graphs}
    factors: dict[int, float] = {}
    said = []
    for step in sorted(set.intersection(*(set(g.steps) for g in graphs))):
        compute = {g.rank: covered((g.steps[step].start, g.steps[step].end), busy[g.rank]) for g in graphs}
        slowest = max(compute, key=compute.__getitem__)
        middle = median(compute.values())
        if math.isclose(compute[slowest], middle, rel_tol=1e-6) or compute[slowest] < middle:
            said.append(f"no straggler, step {step}: no rank computed longer than the median rank's "
                        f"{_ms(middle)}: nothing to bring to the median")
            continue
        g = next(g for g in graphs if g.rank == slowest)
        window, f = g.steps[step], middle / compute[slowest]
        work = [op for op in g.gpu_ops() if op.collective is None and window.start <= op.enqueued < window.end]
        factors.update({id(op): f for op in work})
        said.append(f"no straggler, step {step}: rank {slowest} computed {_ms(compute[slowest])} against the median "
                    f"rank's {_ms(middle)}: its {len(work):,} GPU ops launched in the step (not NCCL's) take "
                    f"{f:.3f} of their measured time")
    return factors, said


def _steps(base: Replay, new: Replay) -> list[StepWhatIf]:
    after = {(s.rank, s.step): s.replayed for s in new.steps}
    return [StepWhatIf(s.rank, s.step, s.measured / 1e6, s.replayed / 1e6, after[(s.rank, s.step)] / 1e6)
            for s in base.steps]


def _describe(change: Change, graphs: list[ExecGraph], host: dict[int, str], compute: dict[int, str],
              together: bool) -> list[str]:
    """One sentence per changed part, with how much measured work it touched in the traces."""
    gpu = graphs[0].on_gpu
    kernels = [op for g in graphs for op in g.gpu_ops() if op.collective is None and op.kind == "kernel"]
    nccl = [op for g in graphs for op in g.gpu_ops() if op.collective is not None]
    out = []
    if change.kernels != 1.0:
        if gpu:
            out.append(f"kernels {change.kernels:g}x faster: the {len(kernels):,} GPU kernels that are not NCCL's "
                       f"({_ms(sum(op.end - op.start for op in kernels))} in the traces) take 1/{change.kernels:g} "
                       "of their measured time; copies and memsets do not change")
        else:
            out.append(f"kernels {change.kernels:g}x faster: a CPU run, so the host time in compute ops (CPU ops "
                       f"outside communication, stalls and data waits; {_ms(_host_time(graphs, host, COMPUTE))} in the "
                       f"traces) takes 1/{change.kernels:g}")
    out += _describe_classes(change, graphs, host, compute)
    if change.comm != 1.0:
        if gpu and not nccl:
            out.append(f"communication {change.comm:g}x faster: the traces hold no NCCL kernel, so nothing changes")
        elif gpu:
            which = ("their transfers (after the last member arrived, where every member is traced; all of the kernel "
                     "otherwise)" if together else "all of each kernel, its wait for peers included (ranks replayed "
                                                       "alone)")
            out.append(f"communication {change.comm:g}x faster: the {len(nccl):,} NCCL kernels "
                       f"({_ms(sum(op.end - op.start for op in nccl))} in the traces): {which} take "
                       f"1/{change.comm:g} of their measured time")
        else:
            out.append(f"communication {change.comm:g}x faster: the host time inside gloo ranges and c10d calls "
                       f"({_ms(_host_time(graphs, host, COMM))} in the traces) takes 1/{change.comm:g}")
    if change.no_launch_gaps:
        out.append("no launch gaps (as CUDA graphs would have it): host time takes none but data waits and blocking "
                   "syncs, so each GPU op starts once its stream and the work it waits for allow; each trace's "
                   "device latencies stay (" + "; ".join(_latencies(g) for g in graphs) + ")")
    return out


def _describe_classes(change: Change, graphs: list[ExecGraph], host: dict[int, str],
                      compute: dict[int, str]) -> list[str]:
    """One sentence per compute class made faster, with how much measured work it touched."""
    out = []
    for cls, k, what in ((MATMUL, change.matmul, "GEMMs"), (ATTENTION, change.attention, "attention")):
        if k == 1.0:
            continue
        if graphs[0].on_gpu:
            ops = [op for g in graphs for op in g.gpu_ops() if op.kind == "kernel" and compute.get(id(op)) == cls]
            out.append(f"{what} {k:g}x faster: the {len(ops):,} {cls} kernels (each by the op that launched it, "
                       f"docs/formulas.md \"Device compute by class\"; {_ms(sum(op.end - op.start for op in ops))} "
                       f"in the traces) take 1/{k:g} of their measured time")
        else:
            ops = [op for g in graphs for t in g.threads for op in t.ops
                   if host.get(id(op)) == COMPUTE and compute.get(id(op)) == cls]
            out.append(f"{what} {k:g}x faster: a CPU run, so the host time in compute ops inside {cls} ops "
                       f"({_ms(length(_outermost(sorted(ops, key=lambda o: (o.start, -o.end)))))} in the traces) "
                       f"takes 1/{k:g}")
    return out


def _notes(change: Change, graphs: list[ExecGraph], together: bool) -> list[str]:
    ranks = sorted(g.rank for g in graphs)
    if together:
        return [f"ranks {span(ranks)} replayed together on one clock: a collective matched across them ends after "
                "its last member arrived, so a change on one rank reaches the others"]
    alone = f"rank {ranks[0]} replayed alone" if len(ranks) == 1 else f"ranks {span(ranks)} replayed each alone"
    why = ("a CPU run: the replay does not match gloo's collectives across ranks; " if not graphs[0].on_gpu else
           "" if len(ranks) == 1 else "not on one host's clock; ")
    return [f"{alone} ({why}a collective keeps its measured wait for its peers, scaled with it when communication "
            "is faster)"]


def _profiled_host(ev: RunEvidence) -> list[str]:
    """A note when the profiler slowed the steps it recorded: a change that leaves the host as the bound is bounded by
    the profiled host, which an unprofiled step does not have."""
    cost = profiler_cost((s for r in ev.ranks.values() for s in r.steps), run_steps(ev))
    if cost is None or cost[0] <= cost[1] * (1 + PROFILER_NOTE):
        return []
    return [f"the replayed steps are profiled ones: this run's profiled steps took {cost[0] * 1e3:.1f} ms against "
            f"{cost[1] * 1e3:.1f} ms unprofiled (medians), the profiler's own cost, whose recording runs on the host; "
            "where a change leaves the host as the bound, an unprofiled step gains more than this says"]


def _host_time(graphs: list[ExecGraph], host: dict[int, str], cls: str) -> float:
    """The time host threads spent in ops of class `cls` (outermost such ops, so nothing is counted twice)."""
    return sum(length(_outermost([op for op in t.ops if host[id(op)] == cls])) for g in graphs for t in g.threads)


def _outermost(ops: list[HostOp]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for op in ops:  # by start, enclosing first
        if not out or op.start >= out[-1][1]:
            out.append((op.start, op.end))
    return out


def _latencies(g: ExecGraph) -> str:
    lat = measure_latencies(g)
    return f"rank {g.rank}: launch {lat.launch:.1f} µs, queue gap {lat.queue:.1f} µs, sync wake-up {lat.wake:.1f} µs"


def _ms(us: float) -> str:
    return f"{us / 1e3:,.2f} ms"
