"""Where each profiled step went: per rank and ProfilerStep window, the terms of docs/formulas.md "Step
decomposition" (ledger.evidence.step_partition), which add up to the measured step, and the replay of the rank's
execution graph (ledger.evidence.replay) judged against the step it replays, with the step's critical path named.

Two passes keep memory to one trace at a time: `add` keeps each traced rank's collectives (small records, from the
summary the reconciliation already made), so that a collective's last member's arrival is known across ranks;
`rows` then reads each trace's execution graph, partitions and replays its steps, and drops it. Each rank is
replayed alone (its collectives keep their measured durations); a multi-rank replay is ledger.evidence.replay's.

Each term's row carries the time model's twin (ledger.models.time_model: the rank's stage on the host's and the
device's clocks, priced with the host costs measured under the profiler) and is judged against it with the term's
tolerance (TOLERANCES; docs/formulas.md "Tolerances" says why each). Where the twin would price an unprofiled step
against a profiled window (host costs without a profiled figure), or there is no host timeline (a CPU rank, no host
costs), the predicted column stays empty and the explanation says why.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from common.ops.compute_class import ATTENTION, CLASSES, MATMUL, OPTIMIZER, OTHER
from ledger.evidence.compute_classes import class_spans, compute_by_class
from ledger.evidence.critical_path import CriticalPath, critical_path
from ledger.evidence.exec_graph import CollectiveId, cyclic_gc_paused, read_graph
from ledger.evidence.layout import group_lists
from ledger.evidence.rank_sets import RankChoice, left_out, ranks_text
from ledger.evidence.replay import StepReplay, replay
from ledger.evidence.run import RankEvidence, RunEvidence
from ledger.evidence.step_partition import (
    COMPUTE,
    DATA_WAIT,
    EXPOSED,
    HOST_BOUND,
    LAUNCH,
    PIPELINE_WAIT,
    SLOWER_RANK,
    SYNC,
    TERMS,
    CommSpan,
    StepPartition,
    device_compute,
    partition_step,
    with_arrivals,
)
from ledger.evidence.trace_groups import attribute_groups, range_kinds
from ledger.evidence.trace_pool import in_workers, pool_size
from ledger.evidence.traces import P2P_KINDS, Collective, TraceSummary
from ledger.models.time_model import StepPrediction
from ledger.reconcile.overlap import kernel_group
from ledger.reconcile.rows import Row, row
from ledger.reconcile.time_rows import TimeModel
from ledger.reconcile.topology import expert_lists

REPLAY_TOLERANCE = 0.03  # docs/formulas.md, "Tolerances"
TERM_METRIC = "step.decomposition."
CLASS_METRIC = "step.device_compute."
REPLAY_METRIC = "step.replay"


@dataclass(frozen=True)
class Tolerance:
    relative: float
    absolute: float  # seconds
    of_step: float = 0.0  # an absolute floor as a fraction of the step (data wait: the time row's max(1 ms, 1%))


# docs/formulas.md, "Tolerances": device compute is the compute sweep's kernels (the time rows' 10%); host-bound
# idle is the host's pace, whose profiled steps themselves spread by 15-30% on the committed traces; launch latency
# is the recipes' kernel count times a gap that spreads 1.64-1.76 µs between eager kernels (1.09 in graph replays);
# a read's round trip is tens of µs; data wait and a slower rank are predicted zero; communication as its row.
TOLERANCES = {COMPUTE: Tolerance(0.10, 0.0), HOST_BOUND: Tolerance(0.25, 1e-3), LAUNCH: Tolerance(0.25, 1e-3),
              SYNC: Tolerance(0.5, 0.2e-3),
              DATA_WAIT: Tolerance(0.0, 1e-3, 0.01), SLOWER_RANK: Tolerance(0.0, 1e-3, 0.01),
              PIPELINE_WAIT: Tolerance(0.25, 2e-3), EXPOSED: Tolerance(0.25, 2e-3)}
# docs/formulas.md, "Tolerances": GEMMs and attention are the compute sweep's kernels at the power limit's clocks
# (the GPU-bound step's 3% goal rests on them); the update is one per-element rate; the other kernels are many
# small memory-bound ones, some no catalogue entry names (autograd's accumulations, casts).
CLASS_TOLERANCES = {MATMUL: Tolerance(0.05, 50e-6), ATTENTION: Tolerance(0.05, 50e-6),
                    OPTIMIZER: Tolerance(0.10, 50e-6), OTHER: Tolerance(0.25, 50e-6)}
MEGATRON_UPDATE = ("not predicted: Megatron-LM's trace marks torch's Optimizer.step alone, while the time model's "
                   "update (optimizer.step_foreach) also holds Megatron's grad clipping and copy into the model's "
                   "params, which run outside it (among the other kernels)")
NO_HOST_TIMELINE = "not predicted: the time model has no host timeline for this rank ({why})"
DEVICE_ONLY = ("device compute predicted alone: the time model's kernels, memset and update of stage {stage}; the "
               "other terms are not (no host timeline: {why})")
UNPROFILED = ("not predicted: the host costs were not measured under the profiler, so the time model's twin ({value}) "
              "would price an unprofiled step against this profiled window")


@dataclass
class _Traced:
    rank: int
    path: Path
    comm: list[tuple[int, CollectiveId, CommSpan]]


class StepDecomposition:
    def __init__(self, ev: RunEvidence, model: TimeModel | None = None):
        """model: the time model applied to the run (its step's per-stage decompositions are the rows' twins)."""
        self.ev, self.model = ev, model
        self.traced: list[_Traced] = []

    def add(self, r: RankEvidence, summary: TraceSummary, path: Path) -> None:
        """Keep one traced rank's collectives with the group each served."""
        groups, extra = self.ev.groups(r.rank), self._cp_ep_groups(r.rank)
        named = attribute_groups(summary, {**groups, **extra}, self.ev.world_size, range_kinds(r.timing)).summary
        self.traced.append(_Traced(r.rank, path, [
            (r.rank, CollectiveId(c.op, c.group, c.seq), CommSpan(c.start, c.end, group_of(c, groups, extra),
                                                                  c.op in P2P_KINDS)) for c in named.collectives]))

    def _cp_ep_groups(self, rank: int) -> dict[str, tuple[int, ...]]:
        """This rank's context-parallel and expert-parallel groups of more than one rank (ledger.evidence.layout)."""
        layout = self.ev.layout
        lists = {"cp": group_lists(layout)["cp"] if layout is not None else [],
                 "ep": expert_lists(self.ev).get("ep", [])}
        return {kind: tuple(sorted(g)) for kind, gs in lists.items() for g in gs if rank in g and len(g) > 1}

    def rows(self, workers: int | None = None, choice: RankChoice = RankChoice(),
             progress: Callable[[str], None] = lambda _: None) -> tuple[list[Row], list[str]]:
        """The chosen traced ranks' rows, and what was left out (as `missing` sentences). Each chosen rank's graph is
        read and replayed in a worker process (trace_pool: one per core unless `workers` says otherwise), which sends
        back only its rows; every traced rank's collectives still give the arrivals (the slower-rank term)."""
        spans = iter(with_arrivals([item for t in self.traced for item in t.comm]))
        comm = [[next(spans) for _ in t.comm] for t in self.traced]
        traced = sorted(t.rank for t in self.traced)
        chosen = choice.pick(traced)
        start = self._profiler_start()
        jobs = []
        for t, spans_of_rank in zip(self.traced, comm):
            if t.rank in chosen:
                twin = self._twin(t.rank)
                jobs.append(_RankJob(t.rank, t.path, spans_of_rank, *twin, start, *self._class_twin(t.rank, twin[0])))
        count = pool_size(workers, [j.path for j in jobs])
        if jobs:
            progress(f"step decomposition and replay of rank(s) {ranks_text(chosen)}, {count} at a time")
        rows = [r for rank_rows in in_workers(_rank_rows, jobs, count) for r in rank_rows]
        return rows, left_out("step decomposition and replay", traced, chosen, "traced ranks",
                              "--replay-ranks all replays every rank")

    def _twin(self, rank: int) -> tuple[dict[str, float] | None, str, bool]:
        """The rank's stage's predicted terms, the reason its rows carry, and whether the twin names every term (a
        GPU run without a host timeline is predicted its device compute alone)."""
        step = self.model.step if self.model is not None else None
        stage = self.ev.rank_evidence(rank).stage
        if step is None or stage not in step.device_compute:
            return None, NO_HOST_TIMELINE.format(why=self._why()), True
        if stage not in step.decompositions:
            if not self.ev.runs_on_cuda(rank):
                return None, NO_HOST_TIMELINE.format(why=self._why()), True
            return {COMPUTE: step.device_compute[stage]}, DEVICE_ONLY.format(stage=stage, why=self._why()), False
        twin = step.decompositions[stage]
        if not step.decomposition_profiled:
            return None, UNPROFILED.format(value=", ".join(f"{k} {v * 1e3:.3g} ms" for k, v in twin.items() if v)), True
        return twin, ("predicted: the time model's host and device timelines of stage "
                      f"{stage}, host costs under the profiler (docs/formulas.md, \"Host timeline\")"), True

    def _class_twin(self, rank: int, twin: dict[str, float] | None) -> tuple[dict[str, float] | None, str,
                                                                              dict[str, str]]:
        """The rank's stage's device compute by class, where its device-compute term has a twin (`twin`, _twin's);
        what its compute-bound classes were priced at; and the classes it does not predict, with why."""
        if twin is None or COMPUTE not in twin:
            return None, "", {}
        step = self.model.step
        classes = dict(step.device_compute_by_class[self.ev.rank_evidence(rank).stage])
        cfg = self.ev.config
        unpredicted = {OPTIMIZER: MEGATRON_UPDATE} if cfg is not None and cfg.implementation.megatron else {}
        return ({c: t for c, t in classes.items() if c not in unpredicted}, _power_text(step), unpredicted)

    def _profiler_start(self) -> float:
        """What the host timeline's twin adds to a window's first step: the profiler's own start (host costs), which
        this engine's window (no warm-up steps) records; Megatron-LM's schedule starts the profiler in a warm-up
        step before its window (its traces' first steps open 0.2 ms before their first op, as the later ones)."""
        cal = self.model.calibration if self.model is not None else None
        if cal is None or cal.host is None or self.ev.config is None or self.ev.config.implementation.megatron:
            return 0.0
        return cal.host.profiler_start

    def _why(self) -> str:
        m = self.model
        if m is None or m.calibration is None:
            return "no config"
        return "; ".join(m.missing) or m.calibration.host_note or "no host costs"


@dataclass(frozen=True)
class _RankJob:
    rank: int
    path: Path
    spans: list[CommSpan]
    twin: dict[str, float] | None
    why: str
    complete: bool  # the twin names every term (else the terms it lacks are not predicted)
    profiler_start: float = 0.0  # host-bound time the twin adds to the window's first step (the profiler's start)
    classes: dict[str, float] | None = None  # the twin's device compute by class
    clocks: str = ""  # what the twin's GEMMs and attention were priced at
    unpredicted: dict[str, str] = field(default_factory=dict)  # the classes the twin leaves out, with why


def _rank_rows(job: _RankJob) -> list[Row]:
    """One rank's rows: its execution graph read and replayed, each profiled step partitioned into terms (beside the
    twin) and its replay judged with the critical path."""
    with cyclic_gc_paused():
        graph = read_graph(job.path)
        rp = replay([graph])
        out: list[Row] = []
        first = min(graph.steps, default=None)
        spans, compute = class_spans(graph), device_compute(graph)
        for s in rp.steps:
            twin = job.twin
            if twin is not None and s.step == first and job.profiler_start:
                twin = twin | {HOST_BOUND: twin.get(HOST_BOUND, 0.0) + job.profiler_start}
            out += term_rows(job.rank, partition_step(graph, s.step, job.spans), twin, job.why, job.complete)
            out += class_rows(job.rank, s.step, compute_by_class(graph, s.step, spans, compute), job.classes,
                              job.why, job.clocks, job.unpredicted)
            out.append(replay_row(job.rank, s, critical_path(rp, s.rank, s.step)))
    return out


def replay_row(rank: int, s: StepReplay, path: CriticalPath) -> Row:
    """The replayed step judged against its window, with what held its critical path."""
    return row(REPLAY_METRIC, "rank", predicted=s.replayed / 1e6, measured=s.measured / 1e6, unit="s",
               tolerance=REPLAY_TOLERANCE, rank=rank, step=s.step, source="trace",
               explanation=(f"the ProfilerStep#{s.step} window against the replay of this rank's execution graph from "
                            f"its measured durations (docs/formulas.md, \"Replay\"); critical path: "
                            f"{path_text(path.by_kind(), path.length)}; longest on it: "
                            + "; ".join(f"{name} {t_us / 1e3:.3g} ms" for name, t_us in path.top_ops(3))))


def group_of(c: Collective, groups: dict[str, tuple[int, ...]], extra: dict[str, tuple[int, ...]]) -> str:
    """The group a collective served: ledger.reconcile.overlap.kernel_group's (tp, dp, pp, embedding), else cp or ep
    when the evidence names it (its issuing range) or its ranks are that group's."""
    kind = kernel_group(groups, c)
    if kind not in ("other", "unknown"):
        return kind
    if c.issued_as in extra:
        return c.issued_as
    ranks = tuple(sorted(c.group)) if c.group is not None else None
    return next((k for k, g in extra.items() if g == ranks), kind)


def term_rows(rank: int, part: StepPartition, twin: dict[str, float] | None = None, why: str = "",
              complete: bool = True) -> list[Row]:
    """One row per term of a step's partition, in seconds, with its share of the step; judged against `twin` (the
    time model's terms; a term a `complete` twin does not name, a group's exposed communication, is predicted zero,
    one an incomplete twin does not name is not predicted) with the term's tolerance, else unjudged and `why` says
    so."""
    rows = []
    for term, t_us in part.terms:
        tol = TOLERANCES[EXPOSED if term.startswith(EXPOSED + " ") else term]
        predicted = None if twin is None else twin.get(term, 0.0 if complete else None)
        rows.append(row(TERM_METRIC + slug(term), "rank", measured=t_us / 1e6, predicted=predicted, unit="s",
                        tolerance=tol.relative, abs_tolerance=max(tol.absolute, tol.of_step * part.measured / 1e6),
                        rank=rank, step=part.step, source="trace",
                        explanation=(f"{term}: {t_us / part.measured:.1%} of step {part.step} "
                                     f"({part.measured / 1e3:.4g} ms; the terms add up to it, docs/formulas.md \"Step "
                                     f"decomposition\"); {why}")))
    return rows


def class_rows(rank: int, step: int, classes: list[tuple[str, float]], twin: dict[str, float] | None,
               why: str, clocks: str = "", unpredicted: dict[str, str] | None = None) -> list[Row]:
    """One row per compute class of a step's device compute (ledger.evidence.compute_classes), in seconds, judged
    against the time model's kernels of that class with the class's tolerance, else unjudged and `why` (or the
    class's own reason in `unpredicted`) says so; `clocks`: how the twin priced the compute-bound classes."""
    compute = sum(t for _, t in classes)
    unpredicted = unpredicted or {}
    rows = []
    for cls, t_us in classes:
        tol = CLASS_TOLERANCES[cls]
        priced = f"; {clocks}" if clocks and cls in (MATMUL, ATTENTION) else ""
        predicted = None if twin is None or cls in unpredicted else twin.get(cls, 0.0)
        priced_as = f"predicted: the time model's kernels of the class, the calibration's seconds less their launch " \
                    f"gaps{priced}"
        reason = why if twin is None else unpredicted.get(cls, priced_as)
        rows.append(row(CLASS_METRIC + slug(cls), "rank", measured=t_us / 1e6, predicted=predicted, unit="s",
                        tolerance=tol.relative, abs_tolerance=tol.absolute, rank=rank, step=step, source="trace",
                        explanation=(f"{cls}: {t_us / compute if compute else 0.0:.1%} of step {step}'s device "
                                     f"compute ({compute / 1e3:.4g} ms; the classes add up to it, each kernel by the "
                                     f"op that launched it, docs/formulas.md \"Device compute by class\"); "
                                     + reason)))
    return rows


def slug(term: str) -> str:
    """"exposed communication tp" -> "exposed_communication.tp"; "host-bound idle" -> "host_bound_idle"."""
    if term.startswith(EXPOSED + " "):
        return EXPOSED.replace(" ", "_") + "." + term[len(EXPOSED) + 1:]
    return term.replace(" ", "_").replace("-", "_")


def term_of(metric: str) -> str:
    """The term a row of TERM_METRIC names (the inverse of `slug`)."""
    name = metric[len(TERM_METRIC):]
    exposed = EXPOSED.replace(" ", "_") + "."
    if name.startswith(exposed):
        return f"{EXPOSED} {name[len(exposed):]}"
    return next(t for t in TERMS if slug(t) == name)


def path_text(by_kind: dict[str, float], total: float) -> str:
    return ", ".join(f"{kind} {t / 1e3:.3g} ms ({t / total:.0%})"
                     for kind, t in sorted(by_kind.items(), key=lambda kv: -kv[1]) if t >= 0.01 * total)


def class_of(metric: str) -> str:
    """The compute class a row of CLASS_METRIC names (the inverse of `slug`)."""
    return next(c for c in CLASSES if slug(c) == metric[len(CLASS_METRIC):])


def _power_text(step: StepPrediction) -> str:
    """What the class rows' kernels were priced at: the power limit's slowdown at the step's compute-bound share."""
    return (f"the passes' kernels at x{step.power_factor:.3f} their isolated sweep times, the power limit's slowdown "
            f"at the step's compute-bound share {step.power_share:.2f} (docs/formulas.md, \"The power limit in a "
            f"step\")")
