"""The analytic plan of a run: every formula of ledger/formulas applied to one RunConfig, as one JSON-able dict.

`train-ledger plan` prints it; the reconciliation reads the same figures for a run rebuilt from its manifest. Every
figure that has more than one convention names the one it uses beside it.
"""
from __future__ import annotations

from typing import Any

from common.config import RunConfig, tying_reason
from common.config.pipeline_layers import stage_num_layers
from common.ops.sizes import expert_capacity, padded_vocab, uniform_kept_assignments
from ledger.models.formulas import activations, bubble, comm, flops, params
from ledger.models.formulas.buffer_layout import expert_dp_size
from ledger.models.formulas.bytes_per_param import (
    bytes_per_param,
    run_bytes_per_param,
    run_strategy,
)
from ledger.models.formulas.peak_memory import stage_peaks
from ledger.models.formulas.static_memory import (
    largest_dp_rank,
    static_bytes_max,
    static_bytes_per_stage,
    static_bytes_split,
)

BYTES_PER_PARAM_CONVENTION = ("per TP/PP-local parameter: param + main grad + fp32 main param + fp32 grad copy + "
                              "Adam m, v, sharded per strategy, after the first step (Megatron's table); no "
                              "activations, padding or temporaries")
PEAK_CONVENTION = ("static (largest DP rank of the stage, after the first step) + the largest phase of the step "
                   "(ledger/models/formulas/peak_phases.py): this engine's saved activations at the schedule's peak "
                   "and its last stage's loss and output-layer backwards (the loss's gradient, the output weight's "
                   "gradient, the layer's input gradient beside what is still saved); Megatron-LM's layers: their "
                   "saved tensors and the phase's transients (the loss's 16-bit logits, unfused attention's score "
                   "matrices) added, with Megatron's global memory buffer; "
                   "no cuBLAS workspaces (a device's: simulate), CUDA context, NCCL buffers or fragmentation")
RECOMPUTE_CONVENTION = ("activations and peak under the run's recompute mode; *_by_recompute: the same run under each "
                        "mode. selective checkpoints the core attention (SDPA) call, which with flash attention frees "
                        "only its fp32 logsumexp (q, k, v stay as the checkpoint's inputs, the output as linear_proj's "
                        "input); full keeps each checkpointed group's input, plus one group rebuilt in backward")


MOE_CONVENTION = ("per rank of each stage (tp 0, its largest dp x cp rank): dense parameters (attention, norms, "
                  "router, embeddings) reduced and sharded over dp x cp, expert parameters (its E/EP experts a layer) "
                  "over the expert-dp group; all-to-all under uniform routing (each expert gets T k / E of every "
                  "rank's assignments, capped by the capacity factor): size = nccl-tests size, remote = what leaves "
                  "the rank")


def build_plan(cfg: RunConfig) -> dict[str, Any]:
    plan = {"config": _config(cfg), "params": _params(cfg), "memory": _memory(cfg), "pipeline": _pipeline(cfg),
            "comm": _comm(cfg), "flops": _flops(cfg)}
    if cfg.model.is_moe:
        plan["moe"] = _moe(cfg)
    return plan


def _moe(cfg: RunConfig) -> dict[str, Any]:
    m, p = cfg.model, cfg.parallel
    ep = p.expert_model_parallel_size
    per_stage = []
    for pp_rank in range(p.pipeline_model_parallel_size):
        dp_rank, _ = largest_dp_rank(cfg, pp_rank)
        split = static_bytes_split(cfg, 0, pp_rank, dp_rank)
        a2a = comm.ep_collectives(cfg, pp_rank)
        per_stage.append({
            "params": params.params_per_rank_split(cfg, pp_rank),
            "static_bytes": {part: b.to_dict() for part, b in split.items()},
            "all_to_all": {name: {**c.to_dict(), "remote_bytes": c.bytes_per_rank} for name, c in a2a.items()}})
    tokens = comm.routed_tokens(cfg)
    return {"convention": MOE_CONVENTION, "num_experts": m.num_experts, "topk": m.moe_router_topk,
            "expert_ffn_hidden_size": m.expert_ffn_hidden_size, "capacity_factor": m.moe_expert_capacity_factor,
            "ep": ep, "experts_per_rank": m.num_experts // ep, "expert_dp": p.expert_data_parallel_size,
            "expert_tp": p.tensor_model_parallel_size, "params_active": params.active_params(cfg),
            "params_experts_total": params.expert_params_total(m),
            "tokens_per_rank_per_microbatch": tokens,
            "kept_assignments_per_rank_per_microbatch": uniform_kept_assignments(tokens, m),
            "expert_capacity": expert_capacity(tokens, m), "per_stage": per_stage}


def _config(cfg: RunConfig) -> dict[str, Any]:
    p, t = cfg.parallel, cfg.train
    return {"model": cfg.model_preset, "world_size": p.world_size, "tp": p.tensor_model_parallel_size,
            "pp": p.pipeline_model_parallel_size, "cp": p.context_parallel_size, "dp": p.data_parallel_size,
            "ep": p.expert_model_parallel_size,
            "vpp": p.virtual_pipeline_model_parallel_size, "sequence_parallel": p.sequence_parallel,
            "params_dtype": t.params_dtype, "grad_dtype": t.grad_dtype, "strategy": run_strategy(cfg),
            "micro_batch_size": t.micro_batch_size, "global_batch_size": t.global_batch_size,
            "seq_length": cfg.model.seq_length}


def _params(cfg: RunConfig) -> dict[str, Any]:
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    per_rank = [params.params_per_rank(cfg, i) for i in range(cfg.parallel.pipeline_model_parallel_size)]
    padded = padded_vocab(m, tp)
    return {"total": params.params_total(cfg), "per_layer": params.params_per_layer(m),
            "embeddings": "untied" if m.untie_embeddings_and_output_weights else "tied",
            "embeddings_reason": tying_reason(cfg.model_preset, m.untie_embeddings_and_output_weights),
            "embedding_copy_on_last_stage": params.embedding_copy_on_last_stage(cfg),
            "per_component": params.component_counts(m, tp), "per_stage": params.params_per_stage(cfg),
            "layers_per_stage": [stage_num_layers(cfg.parallel, m.num_layers, s)
                                 for s in range(cfg.parallel.pipeline_model_parallel_size)],
            "per_rank": per_rank, "per_rank_max": max(per_rank),
            "vocab": {"size": m.vocab_size, "padded": padded, "padding_rows": padded - m.vocab_size,
                      "rule": f"multiple of make_vocab_size_divisible_by {m.make_vocab_size_divisible_by} x tp {tp}"}}


def _memory(cfg: RunConfig) -> dict[str, Any]:
    pp = cfg.parallel.pipeline_model_parallel_size
    bpp = run_bytes_per_param(cfg)
    static_max, rank_max = static_bytes_max(cfg)
    static_per_stage = static_bytes_per_stage(cfg)
    modes = {label: activations.with_recompute(cfg, r) for label, r in activations.comparison_modes(cfg).items()}
    peaks_by_mode = {label: stage_peaks(c, static_per_stage) for label, c in modes.items()}
    act_by_mode = {label: [s.activations for s in peaks] for label, peaks in peaks_by_mode.items()}
    peak_by_mode = {label: [s.total for s in peaks] for label, peaks in peaks_by_mode.items()}
    run_mode = activations.recompute_label(cfg.recompute)
    return {
        "bytes_per_param": bpp.total, "bytes_per_param_convention": BYTES_PER_PARAM_CONVENTION,
        "bytes_per_param_breakdown": vars(bpp),
        "bytes_per_param_after_optimizer_init": run_bytes_per_param(cfg, "after_optimizer_init").total,
        "static_bytes_per_rank_max": static_max, "static_rank_max": {"tp": rank_max[0], "pp": rank_max[1],
                                                                      "dp": rank_max[2]},
        "static_bytes_per_rank_estimate": max(_static_estimate(cfg, i) for i in range(pp)),
        "static_bytes_per_stage": [s.to_dict() for s in static_per_stage],
        "activation_bytes_per_layer": activations.layer_bytes(cfg),
        "activation_saved_tensors_per_layer": activations.layer_saved_tensors(cfg),
        "activation_in_flight_per_stage": [activations.in_flight(cfg, i) for i in range(pp)],
        "recompute": run_mode, "recompute_convention": RECOMPUTE_CONVENTION,
        "activation_bytes_per_stage": act_by_mode[run_mode],
        "activation_bytes_per_stage_by_recompute": act_by_mode,
        "peak_phase_per_stage": [{"name": p.phase.name, "transients": p.phase.transients, "persistent": p.persistent}
                                 for p in peaks_by_mode[run_mode]],
        "peak_bytes_per_stage": peak_by_mode[run_mode],
        "peak_bytes_per_stage_by_recompute": peak_by_mode,
        "peak_convention": PEAK_CONVENTION,
    }


def _static_estimate(cfg: RunConfig, pp_rank: int) -> float:
    """Bytes per parameter x parameters of a rank: expert parameters at their own sharding (the expert-dp group)."""
    t = cfg.train
    split = params.params_per_rank_split(cfg, pp_rank)
    expert = bytes_per_param(t.params_dtype, t.grad_dtype, run_strategy(cfg), expert_dp_size(cfg)).total
    return run_bytes_per_param(cfg).total * split["dense"] + expert * split["expert"]


def _pipeline(cfg: RunConfig) -> dict[str, Any]:
    p = cfg.parallel.pipeline_model_parallel_size
    v, m = params.num_chunks(cfg), cfg.num_microbatches
    b = bubble.bubble(p, m, v)
    schedule = "no_pipelining" if p == 1 else "1f1b" if v == 1 else "interleaved_1f1b"
    return {"schedule": schedule, "num_microbatches": m, "virtual_stages": v,
            "bubble_fraction": b.of_wall_time, "bubble_convention": bubble.OF_WALL_TIME,
            "bubble_relative_to_compute": b.relative_to_compute,
            "bubble_relative_to_compute_convention": bubble.RELATIVE_TO_COMPUTE}


def _comm(cfg: RunConfig) -> dict[str, Any]:
    per_stage = [{**comm.step_collectives(cfg, i), **comm.ep_collectives(cfg, i)}
                 for i in range(cfg.parallel.pipeline_model_parallel_size)]
    busiest: dict[str, float] = {}
    for stage in per_stage:
        for name, c in stage.items():
            busiest[name] = max(busiest.get(name, 0.0), c.bytes_per_rank)
    return {"convention": comm.CONVENTION + "; bytes_per_step: the stage where each collective is largest",
            "bytes_per_step": busiest,
            "per_stage": [{name: c.to_dict() for name, c in stage.items()} for stage in per_stage]}


def _flops(cfg: RunConfig) -> dict[str, Any]:
    tokens = flops.tokens_per_step(cfg)
    per_step = flops.megatron_flops_per_step(cfg)
    palm = flops.palm_flops_per_token(cfg)
    return {"convention": flops.MEGATRON, "per_step": per_step, "per_token": per_step / tokens,
            "tokens_per_step": tokens,
            "palm_6n": {"convention": flops.PALM_6N, "per_token": palm, "per_step": palm * tokens}}
