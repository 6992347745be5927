"""Mixture-of-experts rows: the expert-parallel all-to-alls predicted from the routing each step observed, against
what the engine's "ep-comm" ranges counted and timed; load imbalance and dropped tokens, shown.

Inputs (the issue 19 team sheet's contract): each rank's step records carry `moe_tokens_per_expert` and
`moe_dropped_tokens`, {"<global layer>": [E counts]} of the assignments its router made in the step's forward passes
(every micro-batch; a recompute's re-run not counted), before and over capacity; the engine's ranges of category
"ep-comm" are named "ep all-to-all dispatch layer{n}" / "... combine layer{n}" with `bytes` (the all-to-all's input
buffer, nccl-tests' size, the rank's own share included) and `remote_bytes` (what left the rank), and
"ep all-to-all counts layer{n}" for the per-expert counts (counted apart: they are not tokens).

Which ranks exchange: the ledger's own expert grid (ledger.evidence.layout with ep on Megatron's order and cp folded
into the expert dp, as Megatron's expert rank generator builds it), EP rank j holding experts j E/EP onwards.

Rows, per rank (docs/formulas.md, "Mixture of experts"):
  moe.all_to_all.bytes_per_step         predicted from the observed routing (ledger/models/formulas/moe.py: 2 (sent +
                                        received) rows a layer, 3 with full recompute; kept = tokens - dropped)
                                        against the ranges' bytes, mean over the steps both have            2%
  moe.all_to_all.remote_bytes_per_step  the same for the bytes that left the rank                             2%
  time.ep_all_to_all_per_step           the all-to-alls' own time: predicted from the volume with the calibration's
                                        fit of all_to_all on the ep group (the start-up sweep's "ep" records:
                                        alpha per call + the busiest rank's remote rows / busbw), against each
                                        call's exchange time, mean over steady steps                    25% or 2 ms
  time.ep_all_to_all_wait_per_step      the rest of the ranges' time: waiting for EP peers (shown, not judged)
  moe.load_imbalance.layer{n}           run: max / mean tokens per expert over the run (shown, not judged)
  moe.dropped_tokens_per_step           assignments over capacity (shown, not judged)
Volumes are exact counts, hence the 2% of every other volume row; the time row's bar is the per-step bar of the
exposed communication rows (ledger/reconcile/overlap.py).

Every all-to-all blocks the compute stream, so all of a rank's range time is exposed; but a range opens when its rank
arrives, and an all-to-all cannot move until the last peer of the EP group has arrived: the rest is waiting for that
peer (its expert compute, which routing imbalance lengthens; on CPU ranks the scheduler), which the link fit does not
price. So a call's exchange time is taken from the EP group's ranges of that call on the timers' wall clock
(`t_start` / `t_end`, as the pipeline rows take theirs; on CUDA the ranks' clocks meet at each step's start,
probes/timers.py, so a skew there reads as exchange or wait): from the last peer's arrival to the first peer's
return, when the exchange has moved its data (a later return adds only the scheduling of the returning rank). On 2
shared CPU cores (gloo EP2, the tiny shape, 4 experts top-2) the wait was one to four times the exchange: ranges
17-43 ms a step, exchanges 7-10 ms, within 15% of the fit. Ranges without wall-clock times, or whose peers' ranges do
not pair up call by call, are judged on their whole time, waiting included, and say so.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from statistics import mean

from common.config import RunConfig
from common.errors import InputError
from common.events import StepRecord, TimingRecord
from common.run_dir import events_path
from ledger.evidence.layout import expert_group_lists, expert_layout
from ledger.evidence.run import RankEvidence, RunEvidence
from ledger.evidence.steps import StepSelection
from ledger.models.formulas.activations import activation_bytes, checkpoint_groups
from ledger.models.formulas.moe import (
    NO_VOLUME,
    AllToAllVolume,
    exchanges,
    layer_volume,
    passes,
)
from ledger.models.formulas.params import chunk_layers, num_chunks
from ledger.models.time_model import CalibrationMissing
from ledger.reconcile.rows import Row, predicted_row, row
from ledger.reconcile.time_rows import TimeModel

CATEGORY = "ep-comm"
TOKENS, DROPPED = "moe_tokens_per_expert", "moe_dropped_tokens"
VOLUME_TOL = 0.02
TIME_TOL, TIME_FLOOR_S = 0.25, 2e-3
Routing = dict[int, list[int]]  # global layer -> counts per global expert


@dataclass(frozen=True)
class StepExchange:
    """One rank's all-to-alls in one step, predicted: the volume, and the bytes that set their time: for each
    all-to-all the busiest rank of the EP group in its busier direction (remote rows), summed."""
    volume: AllToAllVolume
    link_bytes: int


def routing(record: StepRecord, key: str, num_experts: int | None = None, where: Path | None = None) -> Routing | None:
    """A step record's {layer: counts per expert} under `key`, None when absent; counts that are not E non-negative
    integers a layer are bad input (InputError naming the file and step)."""
    counts = getattr(record, key)
    if counts is None:
        return None
    try:
        out = {int(layer): [int(c) for c in per_expert] for layer, per_expert in counts.items()}
    except (AttributeError, TypeError, ValueError):
        out = None
    if out is None or any(min(c, default=0) < 0 or (num_experts is not None and len(c) != num_experts)
                          for c in out.values()):
        raise InputError(where or Path("."), f"step {record.step}: {key} is not {{layer: [{num_experts or 'E'} "
                                             "non-negative counts]}")
    return out


def kept_of(record: StepRecord, num_experts: int, where: Path) -> Routing | None:
    """Assignments kept per layer and expert: tokens per expert minus those dropped over capacity."""
    tokens = routing(record, TOKENS, num_experts, where)
    dropped = routing(record, DROPPED, num_experts, where) or {}
    if tokens is None:
        return None
    kept = {layer: [t - d for t, d in zip(counts, dropped.get(layer, [0] * num_experts))]
            for layer, counts in tokens.items()}
    if any(min(k) < 0 for k in kept.values()) or set(dropped) - set(kept):
        raise InputError(where, f"step {record.step}: {DROPPED} exceeds {TOKENS} or names other layers")
    return kept


def ep_groups(cfg: RunConfig) -> list[list[int]]:
    """Every EP group of the run, members in EP-rank order, on the ledger's own expert grid."""
    p = cfg.parallel
    layout = expert_layout(p.world_size, tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                           ep=p.expert_model_parallel_size, order=p.order)
    return expert_group_lists(layout)["ep"]


def recomputed_layers(cfg: RunConfig, pp_rank: int) -> set[int]:
    """Global layers whose forward a full recompute re-runs (the checkpointed groups of each chunk)."""
    out: set[int] = set()
    for chunk in range(num_chunks(cfg)):
        layers, start = list(chunk_layers(cfg, pp_rank, chunk)), 0
        for count, checkpointed in checkpoint_groups(cfg, pp_rank, chunk):
            if checkpointed:
                out.update(layers[start:start + count])
            start += count
    return out


def predicted_exchanges(cfg: RunConfig, ev: RunEvidence) -> dict[int, dict[int, StepExchange]]:
    """rank -> step -> its predicted all-to-alls, for every step in which each rank of its EP group recorded its
    routing."""
    ep = cfg.parallel.expert_model_parallel_size
    row_bytes = activation_bytes(cfg) * cfg.model.hidden_size
    kept = {rank: {s.step: k for s in r.steps
                   if (k := kept_of(s, cfg.model.num_experts, events_path(ev.run_dir, rank))) is not None}
            for rank, r in ev.ranks.items()}
    out: dict[int, dict[int, StepExchange]] = defaultdict(dict)
    for group in ep_groups(cfg):
        if not all(rank in kept for rank in group):
            continue
        rerun = recomputed_layers(cfg, ev.ranks[group[0]].stage)
        for step in set.intersection(*(set(kept[rank]) for rank in group)):
            layers = set(kept[group[0]][step])
            odd = next((rank for rank in group if set(kept[rank][step]) != layers), None)
            if odd is not None:
                raise InputError(events_path(ev.run_dir, odd), f"step {step}: {TOKENS} names other layers than "
                                                               f"rank {group[0]}'s, its EP peer")
            per_layer = {layer: exchanges([kept[rank][step][layer] for rank in group], ep) for layer in layers}
            # each all-to-all of a layer (a dispatch and a combine a pass) waits for the group's busiest link
            link = sum(2 * passes(layer in rerun) * max(x.link_rows for x in xs) * row_bytes
                       for layer, xs in per_layer.items())
            for j, rank in enumerate(group):
                volume = NO_VOLUME
                for layer, xs in per_layer.items():
                    volume += layer_volume(xs[j], row_bytes, cfg.num_microbatches, layer in rerun)
                out[rank][step] = StepExchange(volume, link)
    return out


def is_tokens(t: TimingRecord) -> bool:
    """A dispatch or combine range (not the counts exchange)."""
    return t.category == CATEGORY and "counts" not in t.name


def measured_per_step(r: RankEvidence, field: str) -> dict[int, float]:
    per_step: dict[int, float] = defaultdict(float)
    for t in r.timing:
        value = getattr(t, field)
        if is_tokens(t) and value is not None and t.step is not None:
            per_step[t.step] += float(value)
    return dict(per_step)


def range_seconds(t: TimingRecord) -> float:
    return t.duration_s if t.duration_s is not None else t.end_s - t.start_s


def volume_rows(cfg: RunConfig, r: RankEvidence, predicted: dict[int, StepExchange]) -> list[Row]:
    rows = []
    for metric, field, what in (("moe.all_to_all.bytes_per_step", "bytes", "size"),
                                ("moe.all_to_all.remote_bytes_per_step", "remote_bytes", "remote")):
        measured = measured_per_step(r, field)
        steps = sorted(set(predicted) & set(measured))
        if not steps:
            continue
        value = (lambda x: x.size_bytes) if what == "size" else (lambda x: x.remote_bytes)
        rows.append(row(metric, "rank", predicted=mean(value(predicted[s].volume) for s in steps),
                        measured=mean(measured[s] for s in steps), unit="bytes", tolerance=VOLUME_TOL,
                        explanation=f"expert-parallel dispatch and combine all-to-alls ({what}: "
                                    + ("nccl-tests size, the rank's own rows included" if what == "size" else
                                       "rows sent to other EP ranks") +
                                    "), predicted from the routing the step records observed (tokens per expert "
                                    "minus dropped, of every rank of the EP group: 2 (sent + received) rows a layer "
                                    f"forward and backward, 3 with full recompute; {cfg.model.hidden_size} values "
                                    f"of {activation_bytes(cfg)} B a row); measured: the ep-comm ranges' {field}, "
                                    f"mean over {len(steps)} step(s); the counts exchanges are not counted",
                        rank=r.rank, stage=r.stage, source="events"))
    return rows


def calls_per_step(r: RankEvidence) -> dict[int, list[TimingRecord]]:
    """A rank's dispatch and combine ranges per step, in the order it ran them."""
    out: dict[int, list[TimingRecord]] = defaultdict(list)
    for t in r.timing:
        if is_tokens(t) and t.step is not None:
            out[t.step].append(t)
    return dict(out)


def exchange_seconds(cfg: RunConfig, ev: RunEvidence) -> dict[int, dict[int, float]]:
    """rank -> step -> its all-to-alls' own time: per call, from the EP group's last arrival to its first return
    (module docstring), summed over the step's calls; only steps whose calls pair up across the group, name by name,
    each with wall-clock times."""
    calls = {rank: calls_per_step(r) for rank, r in ev.ranks.items()}
    out: dict[int, dict[int, float]] = defaultdict(dict)
    for group in ep_groups(cfg):
        if not all(rank in calls for rank in group):
            continue
        for step in set.intersection(*(set(calls[rank]) for rank in group)):
            sequences = [calls[rank][step] for rank in group]
            paired = all(len(seq) == len(sequences[0]) for seq in sequences) and all(
                len({(t.name, t.phase) for t in call}) == 1 and all(t.t_start is not None for t in call)
                for call in zip(*sequences))
            if not paired:
                continue
            seconds = sum(max(0.0, min(t.t_end or 0.0 for t in call) - max(t.t_start or 0.0 for t in call))
                          for call in zip(*sequences))
            for rank in group:
                out[rank][step] = seconds
    return out


def time_rows(cfg: RunConfig, r: RankEvidence, predicted: dict[int, StepExchange], exchange: dict[int, float],
              model: TimeModel, selection: StepSelection) -> list[Row]:
    per_step = {step: sum(map(range_seconds, calls)) for step, calls in calls_per_step(r).items()}
    timed, note = selection.timed(per_step)
    steps = [s for s in timed if s in predicted]
    if not steps:
        return []
    ep = cfg.parallel.expert_model_parallel_size
    fit, why = None, ""
    try:
        fit = model.calibration.comm.fit("ep", "all_to_all") if model.calibration is not None else None
    except CalibrationMissing as exc:
        why = f"; {exc}"
    ranges_s = mean(per_step[s] for s in steps)
    paired = all(s in exchange for s in steps)
    measured = mean(exchange[s] for s in steps) if paired else ranges_s
    selected = f"mean over {selection.counted(steps)}" + (f"; {note}" if note else "")
    text = ("the expert-parallel dispatch and combine all-to-alls, each blocking the compute stream: all "
            f"{ranges_s * 1e3:.3g} ms a step of their ranges is exposed; " + (
                f"measured: each call's exchange, from the EP group's last arrival to its first return (the ranges' "
                f"wall clock), summed a step, {selected}; the remaining {(ranges_s - measured) * 1e3:.3g} ms is "
                "waiting for EP peers (time.ep_all_to_all_wait_per_step)" if paired else
                f"measured: the ranges' whole time, {selected}, waiting for the slowest EP peer included (not "
                "predicted): the EP peers' ranges carry no wall-clock times that pair up call by call"))
    prediction = None
    if fit is not None:
        prediction = mean(predicted[s].volume.calls * fit.alpha + predicted[s].link_bytes * fit.beta for s in steps)
        text = (f"{text}; predicted: per all-to-all the fit's latency plus the busiest rank's remote bytes of the EP "
                f"group of {ep} at the fit's bus bandwidth ({fit.describe()}; a uniform routing's remote bytes are "
                "nccl-tests' size x (n-1)/n, the bus bytes the fit divides)")
    rows = [predicted_row("time.ep_all_to_all_per_step", "rank", predicted=prediction, measured=measured, unit="s",
                          tolerance=TIME_TOL, abs_tolerance=TIME_FLOOR_S, explanation=text + why, rank=r.rank,
                          stage=r.stage, source="timers")]
    if paired:
        rows.append(row("time.ep_all_to_all_wait_per_step", "rank", measured=ranges_s - measured, unit="s",
                        tolerance=0.0, explanation="this rank's dispatch and combine ranges' time before the last EP "
                                                   "peer arrived and after the exchange returned (its peers' expert "
                                                   "compute, which routing imbalance lengthens; on CPU ranks the "
                                                   f"scheduler), {selected}; shown, not judged",
                        rank=r.rank, stage=r.stage, source="timers"))
    return rows


def imbalance_rows(cfg: RunConfig, ev: RunEvidence) -> list[Row]:
    """Per layer, tokens per expert summed over every rank and step: max over mean, with the counts."""
    totals: dict[int, list[int]] = {}
    for r in ev.ranks.values():
        for s in r.steps:
            for layer, counts in (routing(s, TOKENS) or {}).items():
                acc = totals.setdefault(layer, [0] * len(counts))
                totals[layer] = [a + c for a, c in zip(acc, counts)]
    rows = []
    for layer, counts in sorted(totals.items()):
        average = sum(counts) / len(counts)
        rows.append(row(f"moe.load_imbalance.layer{layer}", "run", measured=max(counts) / average if average else None,
                        unit="ratio", tolerance=0.0,
                        explanation=f"layer {layer}: the busiest expert's tokens over the mean, before dropping, "
                                    f"summed over every rank's router and every step (tokens per expert: {counts}); "
                                    "1 is uniform routing; shown, not judged (the load-balancing loss and the "
                                    "data set it)", source="events"))
    return rows


def dropped_rows(r: RankEvidence) -> list[Row]:
    steps = [(routing(s, TOKENS), routing(s, DROPPED)) for s in r.steps]
    steps = [(t, d) for t, d in steps if t is not None and d is not None]
    if not steps:
        return []
    dropped = mean(sum(map(sum, d.values())) for _, d in steps)
    assigned = mean(sum(map(sum, t.values())) for t, _ in steps)
    share = f", {dropped / assigned:.2%} of {assigned:,.0f} assignments" if assigned else ""
    return [row("moe.dropped_tokens_per_step", "rank", measured=dropped, unit="count", tolerance=0.0,
                explanation=f"token-to-expert assignments this rank's router dropped over the experts' capacity, "
                            f"summed over its MoE layers, mean over {len(steps)} step(s){share}; shown, not judged "
                            "(zero without --moe-expert-capacity-factor)", rank=r.rank, stage=r.stage,
                source="events")]


def moe_rows(ev: RunEvidence, model: TimeModel, selection: StepSelection) -> list[Row]:
    cfg = ev.config
    if cfg is None or not cfg.model.is_moe:
        return []
    predicted, exchange = predicted_exchanges(cfg, ev), exchange_seconds(cfg, ev)
    rows: list[Row] = []
    for rank, r in sorted(ev.ranks.items()):
        rows += volume_rows(cfg, r, predicted.get(rank, {}))
        rows += time_rows(cfg, r, predicted.get(rank, {}), exchange.get(rank, {}), model, selection)
        rows += dropped_rows(r)
    return rows + imbalance_rows(cfg, ev)
