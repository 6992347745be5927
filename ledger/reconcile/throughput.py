"""Throughput rows: tokens per step and per second, model TFLOP/s per GPU and MFU under both FLOPs conventions
(Megatron's num_floating_point_operations and PaLM's 6N + 12 L q s), step time against the time model, the
profiler's own cost, and the spread of step time across ranks. Where the steady steps' pace moved by more than the
step-time row's tolerance within the window (PaceDrift), that row says so: its median then mixes two paces.

Step time is judged on steady steps only (ledger.evidence.steps): not the run's first (one-time work) and not the
steps the profiler disturbed, whose time includes the profiler's cost (recording, then the trace export every rank
waits for). That cost is a figure of its own (`throughput.profiler_overhead`: profiled against steady median), so a
slow profiled step explains itself instead of passing for a straggler. A real straggler stays visible: a rank whose
median steady step time exceeds the other ranks' median is off. MFU is only computed for GPUs whose dense peak is
known; on CPU the row says so rather than inventing a peak. An fp8 run (--fp8-format) states MFU in both conventions
in use: over the 16-bit peak (comparable with every other run) and over the fp8 peak (`throughput.mfu_fp8_peak.*`),
the explanation saying what share of the FLOPs ran in fp8.
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import median

from common.events import StepRecord
from common.wording import plural
from ledger.evidence.run import RunEvidence
from ledger.evidence.steps import StepSelection, profiler_cost, steps_text
from ledger.models.formulas.flops import (
    H200_BF16_DENSE_PEAK,
    H200_FP8_DENSE_PEAK,
    fp8_flops_per_step,
    megatron_flops_per_step,
    palm_flops_per_token,
    tokens_per_step,
)
from ledger.reconcile.rows import (
    Row,
    at_most_row,
    identity_row,
    predicted_row,
    row,
    threshold_row,
)

# Dense 16-bit peaks (FLOP/s) by device name fragment; MFU needs the device's own peak, never a guess.
PEAKS = {"H200": H200_BF16_DENSE_PEAK, "H100": 989e12, "A100": 312e12}
FP8_PEAKS = {"H200": H200_FP8_DENSE_PEAK, "H100": 1979e12}  # dense fp8 tensor-core peaks (datasheets); A100 has none
STRAGGLER_TOL = 0.05
STEP_TIME_TOL = 0.05
DRIFT_MIN_STEPS = 6  # steady steps the pace's drift is judged on: two in each third at least


def timed_steps(records: list[StepRecord]) -> list[StepRecord]:
    return [r for r in records if r.step_time_s]


def timed_records(ev: RunEvidence) -> dict[int, list[StepRecord]]:
    """Each rank's step records that carry a step time (ranks with none left out)."""
    records = {rank: timed_steps(r.steps) for rank, r in ev.ranks.items()}
    return {rank: s for rank, s in records.items() if s}


def steady_records(records: dict[int, list[StepRecord]], selection: StepSelection) -> dict[int, list[StepRecord]]:
    """The steady steps' records of each rank (the step-time row's): ranks with none left out."""
    steady = set(selection.steady({s.step for steps in records.values() for s in steps}))
    per_rank = {rank: [s for s in steps if s.step in steady] for rank, steps in records.items()}
    return {rank: s for rank, s in per_rank.items() if s}


def device_peak(ev: RunEvidence, peaks: dict[str, float] = PEAKS,
                precision: str = "16-bit") -> tuple[float | None, str]:
    device = ev.device(min(ev.rank_infos)) if ev.rank_infos else None
    name = (device.name if device is not None else None) or ""
    if device is None or device.type != "cuda":
        kind = device.type if device is not None else "an unknown device"
        return None, f"no MFU on {kind}: no GPU peak to divide by"
    for fragment, peak in peaks.items():
        if fragment in name:
            return peak, f"{name}: dense {precision} peak {peak / 1e12:.0f} TFLOP/s"
    return None, f"no known dense {precision} peak for {name!r}: MFU not computed"


def throughput_rows(ev: RunEvidence, selection: StepSelection, *,
                    predicted_step_time: float | None = None) -> list[Row]:
    """`predicted_step_time`: the time model's step time (None until it is wired: the step_time row says so)."""
    records = timed_records(ev)
    if not records:
        return []
    steps = {s.step for steps in records.values() for s in steps}
    per_rank = steady_records(records, selection)
    steady = _steps_of(per_rank)
    kept, note = selection.timed(steps)
    figures = [s for steps in records.values() for s in steps if s.step in kept]
    step_time = median(s.step_time_s for s in figures)
    tokens = [s.tokens for s in figures if s.tokens is not None]
    where = f"median step time {step_time * 1e3:.1f} ms over {plural(len(figures), 'rank-step')}, " \
            f"{selection.counted(kept)}" + (f"; {note}" if note else "")
    cfg = ev.config
    rows = [identity_row("throughput.tokens_per_step", "run", measured=median(tokens) if tokens else None,
                         unit="tokens", explanation="global batch x sequence length: the engine counts it from the "
                                                    "same two config fields the formula reads", source="events"),
            row("throughput.tokens_per_s", "run", measured=median(tokens) / step_time if tokens else None,
                unit="tokens/s", tolerance=0.0, explanation=where, source="events")]
    rows.append(step_time_row(per_rank, selection, predicted_step_time))
    if cfg is not None:
        rows += flops_rows(ev, step_time, where)
    rows += profiler_rows(records, steady, selection)
    rows += straggler_rows(per_rank, selection)
    return rows


def step_time_row(per_rank: dict[int, list[StepRecord]], selection: StepSelection,
                  predicted: float | None) -> Row:
    times = [s.step_time_s for steps in per_rank.values() for s in steps]
    measured = median(times) if times else None
    text = (f"median over {plural(len(times), 'steady rank-step')}, {selection.counted(_steps_of(per_rank))}" if times
            else
            f"no steady step to judge: every step after the first was disturbed by the profiler "
            f"({selection.describe()})")
    drift = pace_drift(per_rank)
    return predicted_row("throughput.step_time", "run", predicted=predicted, measured=measured, unit="s",
                         tolerance=STEP_TIME_TOL, explanation=text + (f"; {drift.sentence()}" if drift else ""),
                         source="events")


@dataclass(frozen=True)
class PaceDrift:
    """The steady steps' pace early and late in the window (each step its median over ranks), where it moved by more
    than the step-time row's tolerance: the median judged then mixes two paces."""
    first: tuple[int, ...]  # the first third of the steady steps
    last: tuple[int, ...]  # the last third
    early_s: float  # the first third's median step time
    late_s: float

    @property
    def change(self) -> float:
        return self.early_s / self.late_s - 1

    def sentence(self) -> str:
        return (f"the pace {'fell' if self.change > 0 else 'rose'} within the window: steps {steps_text(self.first)} "
                f"{self.early_s * 1e3:.3g} ms against steps {steps_text(self.last)} {self.late_s * 1e3:.3g} ms "
                f"({self.change:+.1%}), more than {STEP_TIME_TOL:.0%}: the median mixes two paces (a warm-up longer "
                f"than the steps left out, or a host whose pace drifted); a longer run judges the steady step")


def pace_drift(per_rank: dict[int, list[StepRecord]]) -> PaceDrift | None:
    """The first third of the steady steps against the last (six steps at least), where their medians differ by more
    than the row's tolerance; None when the pace held."""
    by_step: dict[int, list[float]] = {}
    for steps in per_rank.values():
        for s in steps:
            by_step.setdefault(s.step, []).append(s.step_time_s)
    order = sorted(by_step)
    third = len(order) // 3
    if third < DRIFT_MIN_STEPS // 3:
        return None
    first, last = tuple(order[:third]), tuple(order[-third:])
    drift = PaceDrift(first, last, *(median(median(by_step[s]) for s in part) for part in (first, last)))
    return drift if abs(drift.change) > STEP_TIME_TOL else None


def flops_rows(ev: RunEvidence, step_time: float, where: str) -> list[Row]:
    cfg = ev.config
    peak, peak_note = device_peak(ev)
    fp8_peak, fp8_note = device_peak(ev, FP8_PEAKS, "fp8") if cfg.implementation.fp8 else (None, "")
    conventions = {"megatron": megatron_flops_per_step(cfg),
                   "palm_6n": palm_flops_per_token(cfg) * tokens_per_step(cfg)}
    rows = []
    for name, flops in conventions.items():
        per_gpu = flops / step_time / ev.world_size
        rows.append(row(f"throughput.tflops_per_gpu.{name}", "run", measured=per_gpu / 1e12, unit="TFLOP/s",
                        tolerance=0.0, explanation=f"{flops:.3e} FLOPs per step ({name} convention) / step time / "
                                                   f"{ev.world_size} GPUs; {where}", source="events"))
        rows.append(row(f"throughput.mfu.{name}", "run", measured=per_gpu / peak if peak else None,
                        unit="fraction", tolerance=0.0, explanation=peak_note, source="events"))
        if cfg.implementation.fp8:
            share = fp8_flops_per_step(cfg) / flops
            rows.append(row(f"throughput.mfu_fp8_peak.{name}", "run",
                            measured=per_gpu / fp8_peak if fp8_peak else None, unit="fraction", tolerance=0.0,
                            explanation=f"{fp8_note}; {share:.1%} of the FLOPs ran in fp8 (the layers' linears"
                                        f"{' and the output layer' if cfg.implementation.fp8_output_layer else ''})",
                            source="events"))
    return rows


def profiler_rows(records: dict[int, list[StepRecord]], steady: set[int], selection: StepSelection) -> list[Row]:
    """The profiler's cost as a measured figure: median profiled step time / median steady step time - 1."""
    cost = profiler_cost((s for steps in records.values() for s in steps), selection)
    if cost is None:
        return []
    profiled, normal = cost
    rows = [row("throughput.profiler_overhead", "run", measured=profiled / normal - 1,
                unit="fraction", tolerance=0.0,
                explanation=f"median profiled step {profiled * 1e3:.1f} ms against median steady step "
                            f"{normal * 1e3:.1f} ms ({selection.counted(steady)}): the profiler's own cost, "
                            "which is why profiled steps are not judged as normal ones", source="events")]
    spreads = _spreads(records, selection.disturbed)
    if spreads:
        worst = max(spreads, key=spreads.get)
        rows.append(row("throughput.step_time_spread_profiled", "run", measured=spreads[worst], unit="fraction",
                        tolerance=0.0, step=worst, source="events",
                        explanation=f"(max - min) / median step time across ranks over the profiler's steps, worst "
                                    f"step {worst}: ranks record and export traces at different speeds and the "
                                    "collectives make the others wait (not judged)"))
    return rows


def straggler_rows(per_rank: dict[int, list[StepRecord]], selection: StepSelection) -> list[Row]:
    """Per rank: its median steady step time against the other ranks' median (a faster rank is no straggler); per
    run: the worst per-step spread (max - min) / median on steady steps."""
    rows = []
    medians = {rank: median(s.step_time_s for s in steps) for rank, steps in per_rank.items()}
    for rank, mine in sorted(medians.items()):
        others = [m for other, m in medians.items() if other != rank]
        if others:
            rows.append(at_most_row("throughput.step_time_vs_other_ranks", "rank", reference=median(others),
                                    measured=mine, unit="s", tolerance=STRAGGLER_TOL,
                                    explanation="this rank's median steady step time against the other ranks' "
                                                f"median ({selection.counted(_steps_of(per_rank))}); above it: "
                                                "a straggler",
                                    rank=rank, source="events"))
    spreads = _spreads(per_rank)
    if spreads:
        worst = max(spreads, key=spreads.get)
        rows.append(threshold_row("throughput.step_time_spread", "run", measured=spreads[worst],
                                  warn_at=STRAGGLER_TOL, off_at=4 * STRAGGLER_TOL, unit="fraction",
                                  explanation=f"(max - min) / median step time across ranks on steady steps, worst "
                                              f"step {worst} ({selection.counted(_steps_of(per_rank))})",
                                  step=worst, source="events"))
    return rows


def _steps_of(per_rank: dict[int, list[StepRecord]]) -> set[int]:
    return {s.step for steps in per_rank.values() for s in steps}


def _spreads(per_rank: dict[int, list[StepRecord]], only: frozenset[int] | None = None) -> dict[int, float]:
    """(max - min) / median across ranks of each step seen on more than one rank (of `only`, when given)."""
    by_step: dict[int, list[float]] = {}
    for steps in per_rank.values():
        for s in steps:
            if only is None or s.step in only:
                by_step.setdefault(s.step, []).append(s.step_time_s)
    return {step: (max(t) - min(t)) / median(t) for step, t in by_step.items() if len(t) > 1}
