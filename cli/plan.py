"""`train-ledger plan`: the analytic memory / comm / FLOPs plan of a configuration, torch-free.

Takes the same Megatron flags (or --model PRESET) as `train`, plus --world-size; --json prints the plan dict. Or a
Megatron-LM command line as it is: `--megatron-args "<pretrain_gpt.py flags>"` or the flags after `--`, read as
Megatron-LM reads them (its defaults, its layer flavour, its implementation: cli/args.py megatron_command_line); the
output starts with which flags changed the prediction, which do not affect it and which the formulas do not model.
"""
from __future__ import annotations

import json
from typing import Any

from cli.args import CommandParser, help_wanted, megatron_command_line, print_help
from common.arguments import build_parser, parse_args
from common.errors import ConfigError
from common.wording import plural
from ledger.models.plan import build_plan
from ledger.present.units import si, size


def _coords(coords: dict[str, int]) -> str:
    return " ".join(f"{axis} {index}" for axis, index in coords.items())


def _embeddings(params: dict[str, Any]) -> str:
    reason = params["embeddings_reason"]
    if params["embeddings"] == "untied":
        return f"untied embedding and output layer {reason}"
    copy = "; the last stage holds a copy" if params["embedding_copy_on_last_stage"] else ""
    return f"tied embedding and output layer {reason}{copy}"


def _other_recompute_modes(memory: dict[str, Any], stage: int) -> str:
    peaks = memory["peak_bytes_per_stage_by_recompute"]
    return "; ".join(f"{label}: activations {size(act[stage])}, peak {size(peaks[label][stage])}"
                     for label, act in memory["activation_bytes_per_stage_by_recompute"].items()
                     if label != memory["recompute"])


def _moe_lines(moe: dict[str, Any]) -> list[str]:
    """Dense and expert parts per rank and the all-to-all of each stage (plan["moe"], MoE models only)."""
    cf = moe["capacity_factor"]
    capacity = (f", capacity factor {cf:g} ({moe['expert_capacity']} assignments an expert per rank and micro-batch)"
                if cf is not None else ", no capacity (nothing dropped)")
    lines = ["", f"mixture of experts: {moe['num_experts']} experts of f {moe['expert_ffn_hidden_size']}, top-"
                 f"{moe['topk']}{capacity}; ep {moe['ep']} ({moe['experts_per_rank']} experts a rank and layer), "
                 f"expert dp {moe['expert_dp']}, expert tp {moe['expert_tp']}; {moe['params_active']:,} parameters "
                 f"active per token ({moe['params_experts_total']:,} in experts)",
             f"  {moe['tokens_per_rank_per_microbatch']:,} tokens a rank and micro-batch, "
             f"{moe['kept_assignments_per_rank_per_microbatch']:,} kept assignments [{moe['convention']}]"]
    for i, stage in enumerate(moe["per_stage"]):
        pa, sb = stage["params"], stage["static_bytes"]
        lines.append(f"  stage {i}: parameters dense {pa['dense']:,}, expert {pa['expert']:,}; static dense "
                     f"{size(sb['dense']['total'])}, expert {size(sb['expert']['total'])} (padding "
                     f"{size(sb['expert']['padding'])})")
        for name, c in stage["all_to_all"].items():
            lines.append(f"    {name}: {plural(c['calls'], 'all-to-all')}, size {size(c['size_bytes'])} a step, "
                         f"{size(c['remote_bytes'])} leaving the rank")
    return lines


def _transients(memory: dict[str, Any], stage: int) -> str:
    """What the peak holds beside the saved activations: the phase's transients and persistent buffers."""
    phase = memory["peak_phase_per_stage"][stage]
    extra = {**phase["transients"], **phase["persistent"]}
    return "; in the peak: " + ", ".join(f"{name} {size(n)}" for name, n in extra.items()) if extra else ""


def render(plan: dict[str, Any]) -> str:
    c, pa, me, pi, co, fl = (plan[k] for k in ("config", "params", "memory", "pipeline", "comm", "flops"))
    vpp = f" x vpp {c['vpp']}" if c["vpp"] else ""
    lines = [
        f"model {c['model'] or 'custom'}: world {c['world_size']} = tp {c['tp']} x pp {c['pp']}{vpp}"
        f"{' x cp ' + str(c['cp']) if c['cp'] > 1 else ''} x dp {c['dp']}"
        f"{' (ep ' + str(c['ep']) + ')' if c['ep'] > 1 else ''}"
        f"{' + SP' if c['sequence_parallel'] else ''}; {c['params_dtype']} params, {c['grad_dtype']} grads, "
        f"{c['strategy']}; seq {c['seq_length']}, micro {c['micro_batch_size']}, global {c['global_batch_size']}",
        f"parameters: {pa['total']:,} total ({_embeddings(pa)}), {pa['per_layer']:,} per layer; vocab "
        f"{pa['vocab']['size']:,} padded to {pa['vocab']['padded']:,} (+{pa['vocab']['padding_rows']} rows, "
        f"{pa['vocab']['rule']})",
        f"bytes per parameter: {me['bytes_per_param']:g} ({me['bytes_per_param_after_optimizer_init']:g} after "
        f"optimizer init, before Adam's first step)",
        f"pipeline: {pi['schedule']}, m = {plural(pi['num_microbatches'], 'micro-batch')} per DP replica; bubble "
        f"{pi['bubble_fraction']:.2%} [{pi['bubble_convention']}], {pi['bubble_relative_to_compute']:.2%} "
        f"[{pi['bubble_relative_to_compute_convention']}]",
        f"activation recompute: {me['recompute']} [{me['recompute_convention']}]",
        "",
        "per stage, one rank (tp 0; static of its largest DP rank):",
    ]
    for i, per_rank in enumerate(pa["per_rank"]):
        s = me["static_bytes_per_stage"][i]
        lines += [
            f"  stage {i}: {pa['layers_per_stage'][i]} layer(s), {pa['per_stage'][i]:,} params, "
            f"{per_rank:,} per TP rank",
            f"    static {size(s['total'])}: param buffer {size(s['param_buffer'])}, grad buffer "
            f"{size(s['grad_buffer'])} (padding {size(s['padding'])}), master {size(s['master_params'])}, "
            f"Adam m {size(s['adam_m'])}, v {size(s['adam_v'])}, fp32 grad copy {size(s['grad_fp32_copy'])}",
            f"    activations {size(me['activation_bytes_per_stage'][i])} "
            f"({me['activation_in_flight_per_stage'][i]} in flight, recompute {me['recompute']})"
            + _transients(me, i),
            f"    peak {size(me['peak_bytes_per_stage'][i])} ({me['peak_phase_per_stage'][i]['name']})",
            f"    other recompute modes: {_other_recompute_modes(me, i)}",
        ]
        for name, col in co["per_stage"][i].items():
            lines.append(f"    comm {name}: {plural(col['calls'], 'call')}, {size(col['bytes_per_rank'])} per rank")
    lines += [
        "",
        f"static per rank, max: {size(me['static_bytes_per_rank_max'])} at {_coords(me['static_rank_max'])} "
        f"(estimate bytes/param x params: {size(me['static_bytes_per_rank_estimate'])})",
        f"FLOPs per step: {si(fl['per_step'], 'FLOP')} [{fl['convention']}], {si(fl['per_token'], 'FLOP')} "
        "per token",
        f"FLOPs per step: {si(fl['palm_6n']['per_step'], 'FLOP')} [{fl['palm_6n']['convention']}]",
    ]
    if "moe" in plan:
        lines += _moe_lines(plan["moe"])
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = CommandParser("plan", add_help=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--json", action="store_true", help="the plan as one JSON object on stdout")
    p.add_argument("--megatron-args", help="a Megatron-LM pretrain_gpt.py command line, as one string (or its flags "
                                           "after --)")
    p.add_argument("--world-size", type=int)
    own, megatron = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, None)
    if help_wanted(own):
        print_help(p, build_parser("train-ledger plan"))
        return 0
    ns, rest = p.parse_known_args(own)
    if ns.megatron_args is not None or megatron is not None:
        if rest:
            raise ConfigError(f"with a Megatron-LM command line, plan takes only --json and --world-size; "
                              f"unexpected {rest[0]!r}")
        line = megatron_command_line(ns.megatron_args if megatron is None else megatron, ns.world_size)
        plan = build_plan(line.config)
        if ns.json:
            print(json.dumps({**plan, "megatron_flags": vars(line.effects), "assumed": line.assumed}))
        else:
            print("\n".join([*line.lines(), "", render(plan)]))
        return 0
    cfg = parse_args(rest + ([f"--world-size={ns.world_size}"] if ns.world_size is not None else []),
                     prog="train-ledger plan")
    plan = build_plan(cfg)
    print(json.dumps(plan) if ns.json else render(plan))
    return 0
