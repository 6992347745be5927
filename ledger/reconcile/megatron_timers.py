"""Megatron-LM's own timers and throughput, judged against the time model (a Megatron-LM run's evidence keeps their
TensorBoard scalars: ledger/evidence/megatron/ingest.py). Each timer is seconds per iteration, the max over ranks;
measured: the median over the steady steps (ledger.evidence.steps). Predicted, per step, on the stage with the
largest figure (the timers report the slowest rank):

  megatron.timer.forward-compute    m x chunks x one forward pass (time.forward_per_microbatch's)          10%
  megatron.timer.backward-compute   the same for backward                                                   10%
  megatron.timer.forward-backward   the step without the optimizer and the grad-buffer memset: passes,
                                    pipeline bubble, P2P, the grad reduction Megatron waits for             10%
  megatron.timer.optimizer          the optimizer range (time.optimizer_step's)                             10%
  megatron.timer.all-grads-sync     finalize_model_grads: the DP grad reduction's exposed tail, the SP norm-grad
                                    and tied-embedding all-reduces                                   10% or 1 ms
  megatron.timer.params-all-gather  the param all-gather after the optimizer: nothing to gather with one dp x cp
                                    rank (otherwise inside the optimizer prediction, not apart)      10% or 1 ms
  megatron.throughput               Megatron's TFLOP/s per GPU: its FLOP count over the predicted step       5%
  megatron.flops_per_step           Megatron's FLOP count (throughput x iteration-time x world), against the
                                    ledger's count of the same convention (ledger/models/formulas/flops.py)  1%
The other timers Megatron writes (the optimizer's parts, batch-generator, P2P) are shown measured only.
"""
from __future__ import annotations

from statistics import median

from ledger.evidence.megatron.ingest import THROUGHPUT, TIMERS
from ledger.evidence.run import RunEvidence
from ledger.evidence.steps import StepSelection
from ledger.models.formulas.flops import megatron_flops_per_step
from ledger.reconcile.rows import Row, predicted_row, row
from ledger.reconcile.time_rows import TimeModel

TIMER_TOL, COMM_ABS_S, THROUGHPUT_TOL, FLOPS_TOL = 0.10, 1e-3, 0.05, 0.01
COMM_TIMERS = ("all-grads-sync", "params-all-gather")


def _steady(values: dict[int, float], selection: StepSelection) -> tuple[float | None, int]:
    kept = [values[s] for s in selection.steady(values) if s in values]
    return (median(kept) if kept else None), len(kept)


def predictions(ev: RunEvidence, model: TimeModel) -> dict[str, float]:
    """Each judged timer's predicted seconds per step (module docstring)."""
    step = model.step
    if step is None or ev.config is None:
        return {}
    m = ev.config.num_microbatches
    per_stage = [(m * len(s.compute.chunks) * s.compute.forward, m * len(s.compute.chunks) * s.compute.backward,
                  s.optimizer) for s in step.stages]
    terms = step.terms
    sync = sum(terms.get(t, 0.0) for t in ("DP grad reduction tail", "SP norm-grad all-reduce",
                                           "embedding grad all-reduce"))
    found = {"forward-compute": max(f for f, _, _ in per_stage), "backward-compute": max(b for _, b, _ in per_stage),
             "optimizer": max(o for _, _, o in per_stage),
             "forward-backward": step.step_time - terms.get("optimizer", 0.0) - terms.get("grad buffer memset", 0.0),
             "all-grads-sync": sync}
    if ev.config.parallel.data_parallel_size * ev.config.parallel.context_parallel_size == 1:
        found["params-all-gather"] = 0.0
    return found


def timer_rows(ev: RunEvidence, model: TimeModel, selection: StepSelection) -> list[Row]:
    timers: dict[str, dict[int, float]] = ev.manifest.get(TIMERS) or {}
    predicted = predictions(ev, model)
    rows = []
    for name, values in sorted(timers.items()):
        measured, n = _steady(values, selection)
        if measured is None:
            continue
        text = f"Megatron's {name} timer, seconds per iteration (max over ranks): median of {n} steady step(s)"
        if name not in predicted and name not in ("forward-compute", "backward-compute", "forward-backward",
                                                  "optimizer", *COMM_TIMERS):
            rows.append(row(f"megatron.timer.{name}", "run", measured=measured, unit="s", tolerance=TIMER_TOL,
                            explanation=f"{text}; not predicted apart by the time model", source="tensorboard"))
            continue
        rows.append(predicted_row(f"megatron.timer.{name}", "run", predicted=predicted.get(name), measured=measured,
                                  unit="s", tolerance=TIMER_TOL,
                                  abs_tolerance=COMM_ABS_S if name in COMM_TIMERS else 0.0,
                                  explanation=f"{text}; predicted by the time model's step replay",
                                  source="tensorboard"))
    return rows + throughput_rows(ev, model, selection)


def throughput_rows(ev: RunEvidence, model: TimeModel, selection: StepSelection) -> list[Row]:
    tflops: dict[int, float] = ev.manifest.get(THROUGHPUT) or {}
    step_times = {s.step: s.step_time_s for r in ev.ranks.values() for s in r.steps if s.step_time_s}
    if not tflops or ev.config is None:
        return []
    cfg, world = ev.config, ev.world_size
    measured, n = _steady(tflops, selection)
    flops = megatron_flops_per_step(cfg)
    predicted = flops / model.step.step_time / world / 1e12 if model.step is not None else None
    rows = [predicted_row("megatron.throughput", "run", predicted=predicted, measured=measured, unit="TFLOP/s",
                          tolerance=THROUGHPUT_TOL,
                          explanation=f"Megatron's throughput scalar (TFLOP/s per GPU, its FLOP count over its "
                                      f"iteration time): median of {n} steady step(s); predicted: {flops:.4g} FLOP "
                                      "over the predicted step", source="tensorboard")]
    counts = [tflops[s] * step_times[s] * world * 1e12 for s in selection.steady(tflops) if s in step_times]
    if counts:
        rows.append(row("megatron.flops_per_step", "run", predicted=flops, measured=median(counts), unit="FLOP",
                        tolerance=FLOPS_TOL,
                        explanation="Megatron's own FLOP count (num_floating_point_operations: its throughput x "
                                    "iteration-time x world size) against the ledger's count of the same "
                                    "convention (GQA, SwiGLU, causal-halved attention)", source="tensorboard"))
    return rows
