"""`train-ledger simulate`: a layout far beyond this machine, predicted on a GPU kind from its hardware file.

    train-ledger simulate <Megatron flags> --world-size N --hardware H200|H100|A100-80GB|A100-40GB|FILE [--json]
    train-ledger simulate --world-size N --hardware H --megatron-args "<pretrain_gpt.py flags>"   (or them after --)
    train-ledger simulate --validate RUN [RUN ...] [--hardware H] [--json]

The first prints per-stage memory against the device, the step time with its breakdown, tokens/s, TFLOP/s per GPU
and MFU under both conventions, with the textbook figures beside them (ledger/models/simulate/simulation.py). The second
replays real run directories (ours or Megatron-LM's) through the simulator, on the hardware file of the GPU each ran
on, and prints predicted vs measured step time, peak memory and bubble per run (ledger/reconcile/validation.py).
Model flags follow Megatron's semantics: an explicit shape without --swiglu is the GPT layer (GeLU MLP of two
matrices, biases, LayerNorm, learned positions); a --model preset is its own flavour. A Megatron-LM command line
(--megatron-args) is read as Megatron-LM reads it, its implementation (local or Transformer Engine layers, fusions,
optimizer) included; the output starts with which of its flags changed the prediction.
"""
from __future__ import annotations

import json
from typing import Any

from cli.args import CommandParser, help_wanted, megatron_command_line, print_help
from common.arguments import build_parser, parse_args
from common.errors import ConfigError
from common.wording import plural
from ledger.models.simulate.hardware import load_hardware
from ledger.models.simulate.simulation import Simulation, simulate
from ledger.present.units import duration, percent, size
from ledger.reconcile.validation import Validation, validate_run


def _layout(d: dict[str, Any]) -> str:
    vpp = f" x vpp {d['vpp']}" if d["vpp"] else ""
    sp = " + SP" if d["sequence_parallel"] else ""
    cp = f" x cp {d['cp']}" if d["cp"] > 1 else ""
    cp += f" (ep {d['ep']})" if d.get("ep", 1) > 1 else ""
    return (f"tp {d['tp']} x pp {d['pp']}{vpp}{cp} x dp {d['dp']}{sp}, micro {d['micro_batch_size']}, global "
            f"{d['global_batch_size']} ({plural(d['num_microbatches'], 'micro-batch')}), seq {d['seq_length']}, "
            f"recompute {d['recompute']}, {d['strategy']}")


def render(sim: Simulation) -> str:
    d = sim.to_dict()
    hw, step, th, tb = d["hardware"], d["step"], d["throughput"], d["textbook"]
    lines = [f"{d['layout']['world_size']:,} x {hw['name']} ({hw['gpus_per_node']} per node, hardware file "
             f"{hw['version']}): {_layout(d['layout'])}; {d['params']:,} parameters",
             "groups: " + ", ".join(f"{k} {g['size']} over {g['nodes']} node(s) ({g['link']})"
                                    for k, g in d["groups"].items()),
             "", f"memory per GPU ({'fits' if d['memory']['fits'] else 'DOES NOT FIT'} in {size(hw['hbm_bytes'])}):"]
    for m in d["memory"]["per_stage"]:
        kept = "".join(f" + {name} {size(n)}" for name, n in m["persistent"].items())
        lines.append(f"  stage {m['stage']}: {size(m['total'])} ({percent(m['of_hbm'])} of HBM) = static "
                     f"{size(m['static'])}{kept} + activations {size(m['activations'])} ({m['peak_phase']}) + "
                     f"outside PyTorch {size(m['outside_pytorch'])}")
    if "moe" in d:
        moe = d["moe"]
        lines += ["", f"mixture of experts: {moe['num_experts']} experts, top-{moe['topk']}, ep {moe['ep']}, expert dp "
                      f"{moe['expert_dp']}; {moe['params_active']:,} parameters active per token; router, permutes "
                      f"and each expert's GEMMs priced at uniform routing, all-to-alls exposed "
                      f"({duration(moe['all_to_all_step_s'])} a step)"]
        lines += [f"  stage {m['stage']}: parameters dense {m['params']['dense']:,}, expert {m['params']['expert']:,}; "
                  f"static dense {size(m['static_bytes']['dense'])}, expert {size(m['static_bytes']['expert'])}; "
                  f"all-to-all {plural(m['all_to_all_calls'], 'call')}, {size(m['all_to_all_bytes'])} a step "
                  f"({size(m['all_to_all_remote_bytes'])} leaving the rank), {duration(m['all_to_all_s'])} on the "
                  f"ep link" for m in moe["per_stage"]]
    lines += ["", f"step {duration(step['step_time_s'])} (critical stage {step['critical_stage']}):"]
    lines += [f"  {name:<30} {duration(seconds)}" for name, seconds in step["terms_s"].items()
              if abs(seconds) >= 1e-6]  # below a microsecond: rounding of the replay's clock
    lines.append(f"  kernels at x{step['power_limit_factor']:.3f} their isolated times (the power limit at this "
                 f"step's compute-bound share: docs/formulas.md, \"The power limit in a step\")")
    if len(step["per_stage"]) > 1:
        lines.append("  per stage: " + "; ".join(
            f"{s['stage']}: fwd {duration(s['forward_s'])} bwd {duration(s['backward_s'])} per micro-batch, bubble "
            f"{percent(s['bubble'])}" for s in step["per_stage"]))
    lines += ["", f"tokens/s {th['tokens_per_s']:,.0f} ({th['tokens_per_step']:,} tokens per step)",
              *(f"TFLOP/s per GPU {th['tflops_per_gpu'][k]:,.1f}, MFU {percent(th['mfu'][k])} "
                f"[{th['conventions'][k]}]" for k in ("megatron", "palm_6n")),
              f"textbook bubble {percent(tb['bubble_of_wall_time'])} [{tb['bubble_convention']}]; the replay's: "
              + ", ".join(percent(s["bubble"]) for s in step["per_stage"]),
              "notes: " + "; ".join(step["notes"])]
    return "\n".join(lines)


DRIFTED = " ‡"  # marks a step error whose measured median mixes two paces


def render_validation(results: list[Validation]) -> str:
    lines = ["| run | hardware | layout | step predicted / measured | error | peak predicted / measured | error | "
             "bubble predicted / measured | host forward |", "|---|---|---|---|---|---|---|---|---|"]
    for v in results:
        d, e, m = v.to_dict(), v.errors(), v.measured
        lay = d["layout"]
        bubble = ("—" if v.predicted_bubble is None else
                  f"{percent(v.predicted_bubble)} / {percent(m.bubble) if m.bubble is not None else '—'}")
        lines.append(
            f"| {v.run} | {d['hardware']} | tp{lay['tp']} pp{lay['pp']} dp{lay['dp']} mbs{lay['micro_batch_size']} "
            f"gbs{lay['global_batch_size']} seq{lay['seq_length']} | {duration(v.sim.step.step_time)} / "
            f"{duration(m.step_time) if m.step_time else '—'} | {percent(e['step_time'], signed=True)}"
            f"{DRIFTED if m.pace is not None else ''} | "
            f"{size(v.predicted_peak)} / "
            f"{size(m.peak_bytes) if m.peak_bytes else '—'} | {percent(e['peak_bytes'], signed=True)} | {bubble} | "
            f"{'—' if e['host_forward'] is None else percent(e['host_forward'], signed=True)} |")
    ok = sum(v.within_goals() for v in results)
    lines.append(f"\n{ok} of {len(results)} run(s) within the goals (step time 5%, peak memory 3%)")
    drifted = [v for v in results if v.measured.pace is not None]
    if drifted:
        missed = sum(not v.within_goals() for v in drifted)
        lines.append(f"{DRIFTED.strip()} the run's steady pace moved by more than 5% within its window (the first "
                     f"third of its steady steps against the last): its measured median mixes two paces, a warm-up "
                     f"longer than the steps left out or a host whose pace drifted ({len(drifted)} run(s), {missed} "
                     f"of them outside the goals)")
    if any(v.errors()["host_forward"] is not None for v in results):
        lines.append("host forward: the forward range's issue on the host (the timers' host times) against the host "
                     "timeline's from the hardware file's host block, not a goal: a launch-bound step misses where "
                     "its host's pace does")
    lines += [f"{v.run} ran on {v.measured.device}, not on the {v.sim.hardware.name} predicted: its errors hold the "
              "difference between the two GPUs as well as the simulator's" for v in results
              if v.on_predicted_hardware is False]
    lines += [f"{v.run} ran engine/jit.py's fusions eager (TRAIN_LEDGER_COMPILE=0): the simulator prices them "
              "compiled, so its errors hold the eager chains' extra kernels and launches, and at the peak the loss's "
              "fp32 copies of the logits" for v in results if v.eager_fusions]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = CommandParser("simulate", add_help=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--hardware", help="H200, H100, A100-80GB, A100-40GB or a hardware file (required to predict)")
    p.add_argument("--world-size", type=int, help="the number of GPUs to simulate (required to predict)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    p.add_argument("--validate", nargs="+", metavar="RUN", help="predict real runs and compare with what they measured")
    p.add_argument("--megatron-args", help="a Megatron-LM pretrain_gpt.py command line, as one string (or its flags "
                                           "after --)")
    own, megatron = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, None)
    if help_wanted(own):
        print_help(p, build_parser("train-ledger simulate", megatron_model=True))
        return 0
    ns, rest = p.parse_known_args(own)
    if ns.validate:
        if rest:
            raise ConfigError(f"--validate takes run directories only; unexpected {rest[0]!r}")
        results = [validate_run(run, ns.hardware) for run in ns.validate]
        print(json.dumps([v.to_dict() for v in results]) if ns.json else render_validation(results))
        return 0
    if ns.hardware is None:
        raise ConfigError("--hardware is required: H200, H100, A100-80GB, A100-40GB or a hardware file")
    if ns.world_size is None:
        raise ConfigError("--world-size N is required: the number of GPUs to simulate")
    hw = load_hardware(ns.hardware)
    header: list[str] = []
    if ns.megatron_args is not None or megatron is not None:
        if rest:
            raise ConfigError(f"with a Megatron-LM command line, simulate takes only --hardware, --world-size and "
                              f"--json; unexpected {rest[0]!r}")
        line = megatron_command_line(ns.megatron_args if megatron is None else megatron, ns.world_size)
        cfg, header = line.config, [*line.lines(), ""]
    else:
        cfg = parse_args(rest, world_size=ns.world_size, prog="train-ledger simulate", megatron_model=True)
    sim = simulate(cfg, hw)
    print(json.dumps(sim.to_dict()) if ns.json else "\n".join([*header, render(sim)]))
    return 0
