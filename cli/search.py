"""`train-ledger search`: which layout to use for a model on N GPUs of a kind.

    train-ledger search --model M --gpus N --hardware H --global-batch-size B --seq-length S [--top K] [--json]
                        [other Megatron model flags, e.g. an explicit shape]

Enumerates every valid layout (tp, pp, vpp, dp, micro-batch size, recompute, distributed optimizer, sequence
parallel: ledger/models/simulate/layouts.py), drops those that do not fit the device (each stage's peak and the memory
outside PyTorch against the hardware file's HBM), ranks the rest by the time model's tokens/s on the hardware file,
and prints the top K with the term each loses by against the first (ledger/models/simulate/search.py). Model flags
follow Megatron's semantics, as `simulate`'s do.
"""
from __future__ import annotations

import json
import shlex
from typing import Any

from cli.args import CommandParser, help_wanted, print_help
from common.arguments import build_parser, parse_args
from common.config import MAX_WORLD_SIZE
from common.errors import ConfigError
from ledger.models.simulate.hardware import load_hardware
from ledger.models.simulate.layouts import describe, with_layout
from ledger.models.simulate.pricing import Pricing
from ledger.models.simulate.search import SearchResult
from ledger.models.simulate.simulation import Simulation, stage_memory
from ledger.present.search_reason import reason_text
from ledger.present.units import duration, percent, size


def _entry(pricing: Pricing, r) -> dict[str, Any]:
    # the search's own prediction of the layout, not a second replay of it
    sim = Simulation(cfg=r.layout, hardware=pricing.hardware, memory=stage_memory(r.layout, pricing.hardware),
                     step=r.prediction)
    peak = max(m.total for m in sim.memory)
    return {"layout": describe(r.layout), "label": r.label, "tokens_per_s": r.prediction.tokens_per_s,
            "step_time_s": sim.step.step_time, "mfu": sim.mfu(), "tflops_per_gpu": sim.tflops_per_gpu(),
            "peak_bytes": peak, "terms_s": sim.step.terms,
            "loses_because": None if r.reason is None else reason_text(r.reason)}


def to_dict(result: SearchResult, pricing: Pricing, gpus: int, top: int) -> dict[str, Any]:
    hw = pricing.hardware
    return {"hardware": {"name": hw.name, "version": hw.version, "hbm_bytes": hw.hbm_bytes,
                         "gpus_per_node": hw.gpus_per_node},
            "gpus": gpus, "top_k": top, "enumerated": result.enumerated, "fitting": result.fitting,
            "scored": result.scored,
            "skipped_by_bound": result.skipped_by_bound, "dropped": result.dropped,
            "dropped_example": result.dropped_example, "seconds": result.seconds, "cpu_seconds": result.cpu_seconds,
            "top": [_entry(pricing, r) for r in result.ranked]}


def render(d: dict[str, Any]) -> str:
    hw = d["hardware"]
    lines = [f"{d['gpus']:,} x {hw['name']} ({hw['gpus_per_node']} per node, {size(hw['hbm_bytes'])} each, hardware "
             f"file {hw['version']}): {d['enumerated']:,} valid layouts, {d['fitting']:,} fit, {d['scored']:,} "
             f"scored ({d['skipped_by_bound']:,} skipped: their bound cannot reach the top {d['top_k']}) in "
             f"{duration(sum(d['seconds'].values()))} ({duration(d['cpu_seconds'])} of CPU)"]
    lines += [f"  dropped, {kind}: {n:,} (e.g. {d['dropped_example'][kind]})" for kind, n in d["dropped"].items()]
    if not d["top"]:
        return "\n".join(lines + ["no layout fits"])
    lines += ["", "| # | layout | tokens/s | step | MFU (megatron) | peak / GPU | loses to #1 by |",
              "|---|---|---|---|---|---|---|"]
    for i, e in enumerate(d["top"], 1):
        lines.append(f"| {i} | {e['label']} | {e['tokens_per_s']:,.0f} | {duration(e['step_time_s'])} | "
                     f"{percent(e['mfu']['megatron'])} | {size(e['peak_bytes'])} | {e['loses_because'] or '—'} |")
    lines += ["", "#1 term by term:", f"  {d['simulate_first']}"]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    p = CommandParser("search", add_help=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--gpus", type=int, required=True, help="the number of GPUs to lay the model out on")
    p.add_argument("--hardware", required=True, help="H200, H100, A100-80GB, A100-40GB or a hardware file")
    p.add_argument("--top", type=int, default=5, help="how many layouts to show (default 5)")
    p.add_argument("--json", action="store_true", help="one JSON object on stdout")
    if help_wanted(argv):
        print_help(p, build_parser("train-ledger search", megatron_model=True))
        return 0
    ns, rest = p.parse_known_args(argv)
    if not 1 <= ns.gpus <= MAX_WORLD_SIZE:  # the rank groups are enumerated
        raise ConfigError(f"--gpus must be between 1 and {MAX_WORLD_SIZE:,}, got {ns.gpus}")
    if ns.top < 1:
        raise ConfigError(f"--top must be >= 1, got {ns.top}")
    for flag in ("--world-size", "--tensor-model-parallel-size", "--pipeline-model-parallel-size"):
        if flag in rest:
            raise ConfigError(f"{flag}: search chooses the layout; give the model, --gpus and the batch")
    pricing = Pricing(load_hardware(ns.hardware))
    cp = CommandParser("search", add_help=False)
    cp.add_argument("--context-parallel-size", type=int, default=1)
    # the base is parsed at the smallest world its flags allow (cp ranks); each layout gets --gpus
    base = parse_args(rest, world_size=max(1, cp.parse_known_args(rest)[0].context_parallel_size),
                      prog="train-ledger search", megatron_model=True)
    result = pricing.search(base, ns.gpus, ns.top)
    d = to_dict(result, pricing, ns.gpus, ns.top)
    if result.ranked:
        d["simulate_first"] = "train-ledger simulate " + shlex.join(
            with_layout(rest, result.ranked[0].layout) + ["--world-size", str(ns.gpus), "--hardware", ns.hardware])
    print(json.dumps(d) if ns.json else render(d))
    return 0
