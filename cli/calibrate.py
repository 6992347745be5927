"""`train-ledger calibrate --out FILE [--world-size N] (--megatron-args "..." | -- <Megatron-LM flags> | <flags>)`:
this machine's sweeps, alone, for a run that made none (a Megatron-LM run), read back by `reconcile --calibration`.

The compute sweep (probes/compute_sweep) times every catalogue entry of each pipeline stage of the configuration
(Megatron-LM's unfused chains included when the command line selects its local implementation) on this machine's
device (CUDA when present, else CPU), with its per-element work at the rank's own element counts; the file is
JSON Lines, ledger/evidence/calibration_file.py. What is not swept is said in the header and on stdout: the bandwidth
sweep needs the run's ranks (one process here has no group to time: its figures come from the hardware file, or
from a run of ours with --bandwidth-sweep). The host sweep (probes.host_sweep) runs for this engine's layers only:
the time model's host recipes do not describe Megatron-LM's (ledger/models/time_model/host_recipe.py). Main-grad adds
(no gradient-accumulation fusion) are priced, not swept.
"""
from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from cli.args import CommandParser, help_wanted, megatron_command_line, print_help
from common.arguments import build_parser, parse_args
from common.config import RunConfig
from common.errors import ConfigError
from common.events import event
from common.run_dir import atomic_write_text, check_writable, now_iso


def sweep_records(cfg: RunConfig, device, use_cache: bool, before: Callable[[], None] | None = None
                  ) -> tuple[list[dict], str]:
    """Every stage kind's compute records (first, middle, last: the catalogues differ only at the ends), and the
    device they were timed on; `before` runs ahead of each timed call (compute_sweep.run's; runs/bench/l2_state.py)."""
    from engine.probe_adapters import engine_kernels
    from ledger.models.formulas.buffer_layout import rank_buffers
    from ledger.models.formulas.static_memory import owned_per_dp_rank
    from probes import compute_sweep

    kernels = engine_kernels([], cfg.model.vocab_size, device, cfg.implementation.gradient_accumulation_fusion)
    p = cfg.parallel.pipeline_model_parallel_size
    records, seen = [], set()
    for stage in range(p):
        ends = (stage == 0, stage == p - 1)
        if ends in seen:
            continue
        seen.add(ends)
        spec = compute_sweep.SweepSpec.from_run(
            cfg, first_stage=ends[0], last_stage=ends[1], optimizer_numel=max(owned_per_dp_rank(cfg, stage)),
            grad_buffer_numel=sum(b.numel for b in rank_buffers(cfg, stage)))
        try:
            records += compute_sweep.run(spec, device, kernels, use_cache=use_cache, before=before)
        except ValueError as exc:  # an entry no family can time (an MoE model needs the engine's MoE layer)
            raise ConfigError(f"calibrate: {exc}") from None
    return records, compute_sweep.device_name(device)


def host_records(cfg: RunConfig, device) -> tuple[list[dict], str | None]:
    """The host sweep's records, plain and under torch.profiler (probes.host_sweep), where the time model's host
    recipes describe the configuration's layers; else none and why."""
    from ledger.models.time_model.host_recipe import unmodelled_host
    from probes import host_sweep

    why = unmodelled_host(cfg)
    return ([], why) if why else (host_sweep.run(device, profiled=True), None)


def main(argv: list[str]) -> int:
    p = CommandParser("calibrate", add_help=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="the calibration file to write (JSON Lines)")
    p.add_argument("--world-size", type=int)
    p.add_argument("--megatron-args", help="a Megatron-LM pretrain_gpt.py command line, as one string")
    p.add_argument("--no-cache", action="store_true", help="measure even where this machine's cache holds the shapes")
    own, megatron = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, None)
    if help_wanted(own):
        print_help(p, build_parser("train-ledger calibrate", megatron_model=True))
        return 0
    ns, rest = p.parse_known_args(own)
    out = Path(ns.out)
    check_writable(out)
    if ns.megatron_args is not None or megatron is not None:
        if rest:
            raise ConfigError(f"with a Megatron-LM command line, calibrate takes only --out, --world-size and "
                              f"--no-cache; unexpected {rest[0]!r}")
        cfg = megatron_command_line(ns.megatron_args if megatron is None else megatron, ns.world_size).config
    else:
        cfg = parse_args(rest, world_size=ns.world_size, prog="train-ledger calibrate", megatron_model=True)
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    records, device_name = sweep_records(cfg, device, use_cache=not ns.no_cache)
    host, host_note = host_records(cfg, device)
    header = {"calibration": 1, "device": device_name, "made": now_iso(), "command": ["calibrate", *argv],
              "implementation": cfg.implementation.transformer_impl,
              "not_swept": ["bandwidth: one process has no group to time (the hardware file's links, or a run of "
                            "ours with --bandwidth-sweep)"] + ([host_note] if host_note else [])}
    lines = [json.dumps(header)]
    lines += [json.dumps(event("compute", None, **r).to_json()) for r in records]
    lines += [json.dumps(event("host", None, **r).to_json()) for r in host]
    atomic_write_text(out, "\n".join(lines) + "\n")
    print(f"wrote {out}: {len(records)} compute, {len(host)} host records on {device_name}; not swept: "
          f"{'; '.join(header['not_swept'])}")
    return 0
