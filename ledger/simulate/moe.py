"""A mixture-of-experts layout priced on a GPU kind: the time model's step of a dense equivalent, plus the
expert-parallel all-to-alls it does not replay. Torch-free.

    timed = dense_equivalent(cfg)                    # what ledger.time_model prices for an MoE cfg
    step = with_all_to_all(cfg, predict_step(timed, hardware_calibration(timed, hw)), hw)

Why a dense equivalent: the time model (ledger/time_model/ops.py) replays our dense layer op by op and has no expert
kernels. Per token the experts do the GEMMs of one SwiGLU MLP of width k x f_moe (k experts of f_moe each; fewer rows
when a capacity factor drops some under uniform routing: ledger/formulas/moe.py), so the equivalent replaces the MoE
MLP by that dense MLP: the same FLOPs, as one GEMM each instead of E/EP smaller ones (grouped GEMMs of a few hundred
rows run below a large GEMM's efficiency: the step is then optimistic), and the router's small GEMM left out.

The all-to-alls (ledger/formulas/comm.py ep_collectives: dispatch and combine, forward, backward, a full recompute's
re-run, and the per-expert counts) block the compute stream, so all of their time is exposed: each micro-batch's
forward and backward on a stage take their all-to-alls' time longer. With equal stages a step is
(m + (p - 1)/v) x a micro-batch's time on one stage (the bubble formula's v m + p - 1 chunk slots), so the step grows
by that many times a stage's all-to-all time per micro-batch. Each is priced on the ep group's link
(topology.py: inside a node NVLink, across nodes the NICs).
Not modelled: the expert gradients' reduction over the expert-dp group (the equivalent's MLP weights are reduced
over dp x cp instead), load imbalance between EP ranks (uniform routing), the TP all-gather around the experts.
"""
from __future__ import annotations

import dataclasses

from common.config import RunConfig
from ledger.formulas.comm import ep_collectives, routed_tokens
from ledger.formulas.moe import uniform_kept_assignments
from ledger.formulas.params import num_chunks
from ledger.simulate.hardware import Hardware
from ledger.simulate.topology import group_spans, link_for
from ledger.time_model import StepPrediction

TERM = "ep_all_to_all"


def dense_equivalent(cfg: RunConfig) -> RunConfig:
    """cfg itself for a dense model; for an MoE model the same run with a dense SwiGLU MLP of the experts' width
    per token (k x f_moe, scaled by the kept share of the assignments), rounded to a multiple of tp."""
    m = cfg.model
    if not m.is_moe:
        return cfg
    tokens, tp = routed_tokens(cfg), cfg.parallel.tensor_model_parallel_size
    width = m.expert_ffn_hidden_size * uniform_kept_assignments(tokens, m) / tokens
    ffn = max(tp, round(width / tp) * tp)
    model = dataclasses.replace(m, ffn_hidden_size=ffn, num_experts=None, moe_ffn_hidden_size=None)
    return dataclasses.replace(cfg, model=model,
                               parallel=dataclasses.replace(cfg.parallel, expert_model_parallel_size=1))


def all_to_all_seconds(cfg: RunConfig, hw: Hardware) -> list[float]:
    """Each stage's all-to-all seconds in one step (uniform routing), on the ep group's link."""
    spans = group_spans(cfg, hw.gpus_per_node)
    if "ep" not in spans:
        return [0.0] * cfg.parallel.pipeline_model_parallel_size
    link = link_for(spans["ep"], hw)
    ep = cfg.parallel.expert_model_parallel_size
    return [sum(c.calls * link.seconds("all_to_all", ep, c.size_bytes / c.calls)
                for c in ep_collectives(cfg, s).values())
            for s in range(cfg.parallel.pipeline_model_parallel_size)]


def with_all_to_all(cfg: RunConfig, step: StepPrediction, hw: Hardware) -> StepPrediction:
    """The dense equivalent's step with the all-to-alls added (module docstring); unchanged for a dense model."""
    per_stage = all_to_all_seconds(cfg, hw)
    if not cfg.model.is_moe or not any(per_stage):
        return step
    m, p, v = cfg.num_microbatches, cfg.parallel.pipeline_model_parallel_size, num_chunks(cfg)
    added = max(per_stage) / m * (m + (p - 1) / v)
    step_time = step.step_time + added
    stages = tuple(dataclasses.replace(s, exposed={**s.exposed, "ep": per_stage[s.stage]}) for s in step.stages)
    width = dense_equivalent(cfg).model.ffn_hidden_size
    note = (f"MoE: compute priced as a dense MLP of the experts' width per token ({width}); all-to-alls exposed, "
            f"{added * 1e3:.3g} ms a step added (ledger/simulate/moe.py)")
    return dataclasses.replace(step, step_time=step_time, tokens_per_s=step.tokens_per_s * step.step_time / step_time,
                               stages=stages, terms={**step.terms, TERM: added}, notes=(*step.notes, note))
