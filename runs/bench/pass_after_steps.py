"""Is a pass issued slower after training steps than at start-up? A training step issues its passes ~1.3x slower than
the start-up pass timer times them (BENCHMARKS.md, 2026-12-03 seventh and fifteenth entries); a busy device is not why
(sixteenth). This asks whether it is the process's state after training (the caching allocator's pools, caches) or
the training loop's own code around the passes.

    python3 -m torch.distributed.run --standalone --nproc-per-node 1 runs/bench/pass_after_steps.py \\
        [--steps 6] [--rounds 2] -- <engine.train flags>

The run as pretrain builds it (model, optimizer, scheduler, data; no probes, so nothing is recorded), then, each
`--rounds` times: the pass timer (engine/probe_adapters.py pass_timer: forward and backward issue on the host, the
device drained before each), `--steps` training steps (engine/training.py train_step) whose every micro-batch's
forward and backward issue is timed on the host (the schedule's forward_step and custom_backward, wrapped), the pass
timer again after `torch.cuda.empty_cache()`. Prints each measurement's medians and the command. Needs CUDA.
"""
from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from common.arguments import parse_args  # noqa: E402
from common.errors import ConfigError  # noqa: E402
from common.ops import host  # noqa: E402
from engine.data import build_data_iterators  # noqa: E402
from engine.parallel_state import ParallelState  # noqa: E402
from engine.pipeline_parallel import schedules  # noqa: E402
from engine.probe_adapters import pass_timer  # noqa: E402
from engine.train import init_distributed  # noqa: E402
from engine.training import build_schedule_config, forward_step, setup_model_and_optimizer, train_step  # noqa: E402
from probes.probe_set import NullProbeSet  # noqa: E402


def timed(fn: Callable, into: list[float]) -> Callable:
    """fn, appending each call's host seconds to `into`."""
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        into.append(time.perf_counter() - start)
        return out
    return wrapper


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("engine", nargs=argparse.REMAINDER, help="engine.train flags, after --")
    args = ap.parse_args()
    if args.steps < 2 or args.rounds < 1:
        ap.error(f"--steps must be >= 2 (the first is left out) and --rounds >= 1, got {args.steps} and {args.rounds}")
    flags = [f for f in args.engine if f != "--"]
    try:
        cfg = parse_args(flags, world_size=1)
    except ConfigError as exc:
        ap.error(str(exc))
    device = init_distributed()
    state = ParallelState.from_run_config(cfg)
    torch.manual_seed(cfg.train.seed)
    probes = NullProbeSet()
    model, optimizer, scheduler = setup_model_and_optimizer(cfg, state, device, probes)
    data = build_data_iterators(cfg, state, device, probes)
    config = build_schedule_config(cfg, model, state, probes)
    measure = pass_timer(model, cfg, state, device)
    if measure is None:
        raise SystemExit("the pass timer does not run for this layout")
    forwards: list[float] = []
    backwards: list[float] = []
    schedules.forward_step = timed(schedules.forward_step, forwards)
    schedules.custom_backward = timed(schedules.custom_backward, backwards)
    rows = []
    for round_ in range(args.rounds):
        rows.append((f"round {round_ + 1}: pass timer", measure()))
        forwards.clear()
        backwards.clear()
        steps = []
        for _ in range(args.steps):
            start = time.perf_counter()
            loss, _, _ = train_step(forward_step, data, model, optimizer, scheduler, config, cfg, state, device)
            loss.item()
            steps.append(time.perf_counter() - start)
        skip = cfg.num_microbatches  # the first step's
        rows.append((f"round {round_ + 1}: {args.steps} training steps (the first left out)",
                     {"forward": statistics.median(forwards[skip:]), "backward": statistics.median(backwards[skip:]),
                      "step": statistics.median(steps[1:])}))
        rows.append((f"round {round_ + 1}: pass timer after the steps", measure()))
        gc.collect()
        torch.cuda.empty_cache()
        rows.append((f"round {round_ + 1}: pass timer after empty_cache", measure()))
    for name, figures in rows:
        forward = figures.get(host.PASS_FORWARD, figures.get("forward"))
        backward = figures.get(host.PASS_BACKWARD, figures.get("backward"))
        extra = f", step {figures['step'] * 1e3:.1f} ms" if "step" in figures else ""
        print(f"{name}: forward {forward * 1e3:.3f} ms, backward {backward * 1e3:.3f} ms{extra}", flush=True)
    for iterator in data:
        iterator.close()
    dist.destroy_process_group()
    print("command: python3 -m torch.distributed.run --standalone --nproc-per-node 1 runs/bench/pass_after_steps.py "
          f"--steps {args.steps} --rounds {args.rounds} -- {' '.join(flags)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
