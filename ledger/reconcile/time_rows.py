"""Time rows: the time model's predictions (ledger.models.time_model) against the run's own step records and timers.

The prediction reads the run's config and its calibration only: the start-up compute sweep (`compute` events) and
bandwidth sweep (`bandwidth` events), merged over ranks, and, for CPU ranks sharing cores, the manifest's cores and
ranks per host. Never the step times it is judged against. Rows (docs/formulas.md, "Time model", lists the
tolerances and why):

  time.forward_per_microbatch   stage  one forward range of the stage: its layers, + embedding (first stage), final
                                       norm, output layer and loss (last stage), TP collectives inside; against the
                                       median of the stage's forward timer ranges over steady steps            10%
  time.backward_per_microbatch  stage  the same for backward (recompute included)                               10%
  time.optimizer_step           stage  the optimizer range: waiting at the grad-norm all-reduce for the slowest
                                       stage, the update, the synchronous param all-gather                     10%
  time.delayed_wgrad_per_step   stage  --moe-delay-expert-wgrad's flush (its `wgrad` range): the held operands'
                                       concatenations and a wgrad GEMM per expert weight                       10%
  time.tokens_per_s             run    tokens per step / predicted step time, against tokens / median step time  5%
  time.data_wait_per_step       rank   0 (the loader builds ahead), against the step records' data_wait_s,
                                       mean over steady steps (ledger/reconcile/data_wait.py)   max(1 ms, 1% step)
The step time itself is throughput.step_time's (ledger/reconcile/throughput.py): reconcile hands it the prediction,
and `explain_step_time` adds the model's terms and, from the timers, which phase's gap is largest. The model's
per-stage bubble sits beside the textbook one in ledger/reconcile/pipeline.py. Steady steps are
ledger.evidence.steps' (not the first, not the profiler's). Without calibration the rows keep their measurement,
have no prediction and `missing` says why.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import median

from common.config.pipeline_layers import stage_num_layers
from common.errors import ConfigError
from common.ops.sizes import vocab_shard
from common.wording import plural
from ledger.evidence.calibration_file import CalibrationFile
from ledger.evidence.run import RankEvidence, RunEvidence
from ledger.evidence.steps import StepSelection
from ledger.models.formulas.activations import chunk_layers_text
from ledger.models.formulas.flops import tokens_per_step
from ledger.models.formulas.params import num_chunks
from ledger.models.schedule import BACKWARD, FORWARD
from ledger.models.simulate.calibration import hardware_calibration
from ledger.models.simulate.hardware import Hardware, hardware_for, run_device
from ledger.models.time_model import (
    Calibration,
    CalibrationMissing,
    StageTime,
    StepPrediction,
    oversubscription,
    predict_step,
    stage_time,
)
from ledger.models.time_model.host_costs import CPU_NOTE, HostCosts, host_costs
from ledger.models.time_model.host_recipe import unmodelled_host, unpriced_host
from ledger.reconcile.data_wait import data_wait_rows
from ledger.reconcile.rows import Row, row

STEP_TOL = 0.05
STAGE_TOL = 0.10
OPTIMIZER_TOL = 0.10
HOST_RANGE_TOL = 0.25  # the host's pace, as the step decomposition's host-bound idle (docs/formulas.md "Tolerances")
# A term this small is the float residue of the difference that defines it (a single stage's bubble), not time.
NEGLIGIBLE_S = 1e-9


@dataclass(frozen=True)
class TimeModel:
    """The run's predictions: the whole step, or only the stages' passes when a collective's sweep is missing."""
    calibration: Calibration | None
    step: StepPrediction | None = None
    stages: dict[int, StageTime] = field(default_factory=dict)
    missing: tuple[str, ...] = ()


def host_share(ev: RunEvidence) -> tuple[float, str | None]:
    """(compute scale, note) for CPU ranks that outnumber their host's cores: the sweep ran one rank at a time."""
    hosts: dict[str, list[int]] = defaultdict(list)  # host -> each CPU rank's cores
    for info in ev.rank_infos.values():
        if info.device.type == "cpu" and info.host and info.device.cores:
            hosts[info.host].append(info.device.cores)
    threads = max((r.threads or 1 for e in ev.ranks.values() for r in e.compute), default=1)
    scale, note = 1.0, None
    for host, devices in hosts.items():
        cores = devices[0]
        factor = oversubscription(len(devices), cores, threads)
        if factor > scale:
            scale = factor
            note = (f"compute scaled x{factor:.2f}: {len(devices)} ranks of {threads} thread(s) share host {host}'s "
                    f"{cores} cores, and the sweep timed one rank at a time")
    return scale, note


@dataclass(frozen=True)
class TimeSources:
    """Where the time model's calibration comes from beyond the run's own sweeps, which come first:
    `calibration` a file `train-ledger calibrate` wrote on the run's machine, then `hardware` a hardware file
    (`reconcile --calibration FILE --hardware H200`)."""
    hardware: Hardware | None = None
    calibration: CalibrationFile | None = None

    def describe(self) -> str:
        found = ([self.calibration.describe()] if self.calibration else []) + (
            [f"hardware file {self.hardware.name} {self.hardware.version}"] if self.hardware else [])
        return "; ".join(found)


def host_calibration(ev: RunEvidence, hardware: Hardware | None = None) -> tuple[HostCosts | None, str | None]:
    """The host timeline's prices: the run's own host sweep; without one, the host block of `hardware` (--hardware)
    or else of the hardware file of the GPU the run names (said in the note: measured on that file's host, not
    necessarily this run's)."""
    if ev.device_types() == {"cpu"}:
        return None, CPU_NOTE
    own, why = host_costs(r for e in ev.ranks.values() for r in e.host)
    if own is not None or why == CPU_NOTE:
        return own, why
    try:
        hw = hardware or hardware_for(run_device(ev.rank_infos.values()), None)
    except ConfigError:
        return None, why
    if hw.host is None:
        return None, why
    return hw.host, (f"host timeline priced by the {hw.name} hardware file's host block ({Path(hw.path).name}: its "
                     f"source says where it was measured); this run has no host sweep (--host-sweep)")


def calibration(ev: RunEvidence, sources: TimeSources = TimeSources()) -> Calibration:
    """The run's own sweeps, over the calibration file's, over the hardware file's prices of its kernels; no host
    timeline where the host recipes do not describe the run's layers (Megatron-LM's)."""
    scale, note = host_share(ev)
    host, host_note = host_calibration(ev, sources.hardware)
    cal = Calibration.from_records([r for e in ev.ranks.values() for r in e.compute],
                                   [r for e in ev.ranks.values() for r in e.bandwidth], scale, note, host=host,
                                   host_note=host_note)
    if sources.calibration is not None:
        file = sources.calibration
        file_host, file_note = host_costs(file.host)
        cal = cal.over(Calibration.from_records(file.compute, file.bandwidth, host=file_host, host_note=file_note))
    if sources.hardware is not None and ev.config is not None:
        cal = cal.over(hardware_calibration(ev.config, sources.hardware))
    cal = _power_threshold(cal, ev, sources)
    why = unmodelled_host(ev.config) or unpriced_host(ev.config, cal.host) if ev.config is not None else None
    return replace(cal, host=None, host_note=why) if why else cal


def _power_threshold(cal: Calibration, ev: RunEvidence, sources: TimeSources) -> Calibration:
    """A run's own sweep measures the full-load slowdown, not the share of a step's time below which the GPU stays
    under its power limit: that is the GPU kind's (its hardware file's "power_limit" block, --hardware's or the one
    the run's device names)."""
    if cal.power is None or cal.power.threshold_share is not None:
        return cal
    try:
        hw = sources.hardware or hardware_for(run_device(ev.rank_infos.values()), None)
    except ConfigError:
        return cal
    return replace(cal, power=replace(cal.power, threshold_share=hw.sustained.threshold_share))


def predict_run(ev: RunEvidence, sources: TimeSources = TimeSources()) -> TimeModel:
    """The time model applied to the run; a CalibrationMissing becomes a line of `missing`."""
    cfg = ev.config
    if cfg is None:
        return TimeModel(calibration=None)
    cal = calibration(ev, sources)
    step, unpriced = None, None
    try:
        step = predict_step(cfg, cal)
        cal = replace(cal, sustained=step.power_factor)  # the stages' passes at the step's power-limit factor
    except CalibrationMissing as exc:
        unpriced = f"time model: {exc}"
    missing: list[str] = []
    stages: dict[int, StageTime] = {}
    try:
        stages = {s: stage_time(cfg, cal, s) for s in range(cfg.parallel.pipeline_model_parallel_size)}
    except CalibrationMissing as exc:
        missing.append(f"time model: {exc}")
    if unpriced is not None and unpriced not in missing:
        missing.append(f"{unpriced}: no step time prediction")
    return TimeModel(calibration=cal, step=step, stages=stages, missing=tuple(missing))


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _ranges(ranks: list[RankEvidence], category: str, steps: set[int]) -> list[float]:
    return [t.duration_s for r in ranks for t in r.timing
            if t.category == category and t.step in steps and t.duration_s is not None]


def _steps(ev: RunEvidence, selection: StepSelection) -> tuple[set[int], str]:
    timed = {t.step for r in ev.ranks.values() for t in r.timing}
    kept, note = selection.timed(timed)
    return set(kept), "; ".join(x for x in (selection.counted(kept), note) if x)


def _terms_text(terms: dict[str, float], ev: RunEvidence) -> str:
    """The breakdown, largest first, with the parameters behind an end stage's term."""
    cfg = ev.config
    vocab = vocab_shard(cfg)
    params = {"output_layer": vocab * cfg.model.hidden_size, "embedding": vocab * cfg.model.hidden_size}
    parts = []
    for term, seconds in sorted(terms.items(), key=lambda kv: -kv[1]):
        if seconds > NEGLIGIBLE_S:
            extra = f" ({params[term]:,} params)" if term in params else ""
            parts.append(f"{term} {_ms(seconds)}{extra}")
    return ", ".join(parts)


def stage_rows(ev: RunEvidence, model: TimeModel, selection: StepSelection) -> list[Row]:
    cfg = ev.config
    if cfg is None:
        return []
    steps, chosen = _steps(ev, selection)
    rows = []
    for s in range(cfg.parallel.pipeline_model_parallel_size):
        mean_layers = stage_num_layers(cfg.parallel, cfg.model.num_layers, s) / num_chunks(cfg)
        ranks = [r for r in ev.ranks.values() if r.stage == s]
        predicted = model.stages.get(s)
        for kind in ("forward", "backward"):
            measured = _ranges(ranks, kind, steps)
            if predicted is None and not measured:
                continue
            if predicted is not None:
                seconds = getattr(predicted, kind)
                terms = predicted.terms(kind == "forward")
                text = (f"time model, per {kind} range: {_terms_text(terms, ev)}; {chunk_layers_text(cfg, s)} per "
                        f"chunk, {_ms(terms.get('layers', 0.0) / mean_layers if mean_layers else 0.0)} a layer")
                paced = _paced(model, s, kind)
                if paced is not None:
                    text = (f"the host paces the device: the range takes {_ms(paced)} on the host timeline, of which "
                            f"the device computes {_ms(seconds)}; " + text)
                    seconds = paced
            else:
                seconds, text = None, f"no prediction: {'; '.join(model.missing) or 'no config'}"
            if model.calibration is not None and model.calibration.scale_note:
                text += f"; {model.calibration.scale_note}"
            rows.append(row(f"time.{kind}_per_microbatch", "stage", predicted=seconds,
                            measured=median(measured) if measured else None, unit="s", tolerance=STAGE_TOL,
                            explanation=f"{text}; {_measured_text(len(measured), 'timer range(s)', chosen)}",
                            stage=s, rank=ranks[0].rank if ranks else None, source="timers"))
            rows += _host_range_row(model, s, kind, ranks, steps, chosen)
        rows += _optimizer_row(ev, model, s, ranks, steps, chosen)
        rows += _delayed_wgrad_row(ev, model, s, ranks, steps, chosen)
    return rows


def _measured_text(count: int, what: str, chosen: str) -> str:
    """'measured: median of 12 timer range(s), steps 2-14 (...)'; a run that timed none (a Megatron-LM run, one
    without --timers) says so rather than 'median of 0 ... steps ' over no steps."""
    return f"measured: median of {count} {what}, {chosen}" if count else f"not measured: the run recorded no {what}"


def _host_range_row(model: TimeModel, s: int, kind: str, ranks: list[RankEvidence], steps: set[int],
                    chosen: str) -> list[Row]:
    """A forward (backward) range on the host's clock, opened to closed: what the host took to issue it, unprofiled,
    against the host timeline's; none for a run whose timers kept no host times, or timed on the host alone (CPU)."""
    timed = [t for r in ranks for t in r.timing if t.category == kind and t.step in steps and t.clock == "cuda_event"
             and t.host_start_s is not None and t.host_end_s is not None]
    if not timed:
        return []
    measured = [t.host_end_s - t.host_start_s for t in timed]
    behind = max(0.0, median(t.end_s - t.host_end_s for t in timed))  # ~0: the host sets the pace
    hosted = model.step.stages[s].host_ranges if model.step is not None else {}
    predicted = hosted.get(FORWARD if kind == "forward" else BACKWARD)
    why = (model.calibration.host_note if model.calibration is not None else None) or "; ".join(model.missing)
    text = (f"host timeline: the {kind} range's issue on the host, mean over the step's ranges, host costs "
            f"{model.calibration.host.source}" if predicted is not None else f"no prediction: {why or 'no host costs'}")
    return [row(f"time.host_{kind}_per_microbatch", "stage", predicted=predicted, measured=median(measured), unit="s",
                tolerance=HOST_RANGE_TOL, stage=s, rank=ranks[0].rank if ranks else None, source="timers",
                explanation=f"{text}; measured: median of {len(measured)} range(s) from the host's opening call to "
                            f"its closing one, {chosen}; the device was {_ms(behind)} behind the host as it closed the "
                            f"range (median; near 0 where the host sets the pace)")]


def _paced(model: TimeModel, stage: int, kind: str) -> float | None:
    """The range's span on the host timeline when the host makes it longer than its device time, else None."""
    if model.step is None or model.calibration is None or model.calibration.host is None:
        return None
    paced = getattr(model.step.stages[stage], kind)
    return paced if paced > getattr(model.stages[stage], kind) * (1 + 1e-9) else None


def _optimizer_row(ev: RunEvidence, model: TimeModel, s: int, ranks: list[RankEvidence], steps: set[int],
                   chosen: str) -> list[Row]:
    measured = _ranges(ranks, "optimizer", steps)
    predicted = model.step.stages[s].optimizer if model.step is not None else None
    if not measured and predicted is None:
        return []
    text = ("time model: waiting at the grad-norm all-reduce for the slowest stage, the update (optimizer.step per "
            "element of this rank's main params) and any synchronous param all-gather" if predicted is not None
            else f"no prediction: {'; '.join(model.missing)}")
    return [row("time.optimizer_step", "stage", predicted=predicted, measured=median(measured) if measured else None,
                unit="s", tolerance=OPTIMIZER_TOL,
                explanation=f"{text}; {_measured_text(len(measured), 'optimizer range(s)', chosen)}", stage=s,
                rank=ranks[0].rank if ranks else None, source="timers")]


def _delayed_wgrad_row(ev: RunEvidence, model: TimeModel, s: int, ranks: list[RankEvidence], steps: set[int],
                       chosen: str) -> list[Row]:
    """--moe-delay-expert-wgrad's flush, its `wgrad` range against the time model's: the held operands'
    concatenations and one wgrad GEMM per expert weight (no row without the flag)."""
    if not ev.config.model.moe_delay_expert_wgrad:
        return []
    measured = _ranges(ranks, "wgrad", steps)
    predicted = model.step.stages[s].delayed_wgrad if model.step is not None else None
    text = ("time model: per expert weight, its held operands concatenated and one wgrad GEMM over every "
            "micro-batch's rows" if predicted is not None else f"no prediction: {'; '.join(model.missing)}")
    seen = (f"median of {len(measured)} wgrad range(s), {chosen}" if measured
            else "no wgrad range in the run (recorded before the flush had one)")
    return [row("time.delayed_wgrad_per_step", "stage", predicted=predicted,
                measured=median(measured) if measured else None, unit="s", tolerance=STAGE_TOL,
                explanation=f"{text}; measured: {seen}", stage=s, rank=ranks[0].rank if ranks else None,
                source="timers")]


def tokens_row(ev: RunEvidence, model: TimeModel, selection: StepSelection) -> list[Row]:
    records = [s for r in ev.ranks.values() for s in r.steps if s.step_time_s and s.tokens]
    steady = set(selection.steady(s.step for s in records))
    kept = [s for s in records if s.step in steady]
    if ev.config is None or not kept:
        return []
    measured = median(s.tokens for s in kept) / median(s.step_time_s for s in kept)
    predicted = model.step.tokens_per_s if model.step is not None else None
    text = (f"time model: {tokens_per_step(ev.config):,} tokens per step / predicted step "
            f"{_ms(model.step.step_time)}" if model.step is not None
            else f"no prediction: {'; '.join(model.missing)}")
    return [row("time.tokens_per_s", "run", predicted=predicted, measured=measured, unit="tokens/s",
                tolerance=STEP_TOL, explanation=f"{text}; measured: median tokens / median step time over "
                                                f"{plural(len(kept), 'steady rank-step')}, "
                                                f"{selection.counted(steady)}",
                source="events")]


def time_rows(ev: RunEvidence, model: TimeModel, selection: StepSelection) -> list[Row]:
    return stage_rows(ev, model, selection) + tokens_row(ev, model, selection) + data_wait_rows(ev, selection)


def explain_step_time(rows: list[Row], ev: RunEvidence, model: TimeModel, selection: StepSelection) -> None:
    """Add to throughput.step_time the model's terms, largest first, and, where timers measured the critical stage,
    which phase (forward, backward, optimizer) is furthest from its prediction."""
    step = model.step
    if step is None:
        for r in rows:
            if r.metric == "throughput.step_time" and model.missing:
                r.explanation += f"; {'; '.join(model.missing)}"
        return
    cfg, s = ev.config, step.critical_stage
    text = f"time model (critical stage {s}): {_terms_text(step.terms, ev)}; {'; '.join(step.notes)}"
    steps, _ = _steps(ev, selection)
    ranks = [r for r in ev.ranks.values() if r.stage == s]
    stage = step.stages[s]
    items = cfg.num_microbatches * len(stage.compute.chunks)
    predicted = {"forward": items * stage.forward, "backward": items * stage.backward, "optimizer": stage.optimizer}
    per_step = {kind: sum(_ranges(ranks, kind, steps)) / (len(steps) * len(ranks)) for kind in predicted
                if ranks and steps and _ranges(ranks, kind, steps)}
    if per_step:
        kind = max(per_step, key=lambda k: abs(per_step[k] - predicted[k]))
        text += (f"; largest gap per step on stage {s}: {kind} measured {_ms(per_step[kind])} against "
                 f"{_ms(predicted[kind])} predicted")
    for r in rows:
        if r.metric == "throughput.step_time":
            r.explanation += f"; {text}"
