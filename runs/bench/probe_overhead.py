"""Probe overhead: the median step time with every probe on (profiler window and memory history excluded) over the
median with probes off, in one process on one device, steps alternating on/off so that drift (clocks, thermals,
allocator warm-up) hits both sides alike. Goal: ratio <= 1.01.

    python runs/bench/probe_overhead.py                      # llama3.2-1b, bf16, on cuda:0
    python runs/bench/probe_overhead.py --model tiny         # CPU smoke test
    python runs/bench/probe_overhead.py --steps 40 -- --seq-length 2048 --global-batch-size 4   # Megatron flags

A step is timed from before step_begin to after step_end, so the probes' own step-end work (timer read-back, memory
stats, the fsync of the event file) is counted, not only what they add inside the step. The engine holds one probes
object for its whole life, so the benchmark hands it a `ProbeToggle` that forwards to the live ProbeSet or to
NullProbeSet; the toggle's own forwarding cost falls on both sides.
"""
from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.arguments import parse_args  # noqa: E402
from common.config import RunConfig  # noqa: E402
from engine.data import build_data_iterators  # noqa: E402
from engine.model_builder import get_model  # noqa: E402
from engine.optimizer import get_megatron_optimizer  # noqa: E402
from engine.optimizer.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from engine.parallel_state import ParallelState  # noqa: E402
from engine.training import build_schedule_config, forward_step, train_step  # noqa: E402
from probes.probe_set import NullProbeSet, create_probe_set  # noqa: E402


class ProbeToggle:
    """Forwards every facade call to the live probes or to NullProbeSet, switchable between steps."""

    def __init__(self, live: Any):
        self.live, self.null = live, NullProbeSet()
        self.target: Any = self.null

    def __getattr__(self, name: str) -> Any:
        return getattr(self.target, name)


def _options(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--steps", type=int, default=20, help="timed steps per side (on and off)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first, probes off")
    p.add_argument("--run-dir", help="where the probes write (default: a temporary directory)")
    return p.parse_known_args(argv)


def _run_config(opts: argparse.Namespace, megatron_flags: list[str], run_dir: str) -> RunConfig:
    flags = ["--model", opts.model, "--micro-batch-size", "1", "--global-batch-size", "8", "--mock-data",
             "--train-iters", str(opts.warmup + 2 * opts.steps)]
    if torch.cuda.is_available():
        flags.append("--bf16")
    flags += [f for f in megatron_flags if f != "--"] + ["--all-probes", "--run-dir", run_dir]
    return parse_args(flags, world_size=1)


def _init(device: torch.device, store: str) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)


def measure(run_config: RunConfig, device: torch.device, warmup: int, steps: int) -> dict[str, list[float]]:
    """Step times in seconds, per side; every probe facade call of a real run happens on the "on" steps."""
    ps = ParallelState.initialize(1, 1)
    toggle = ProbeToggle(create_probe_set(run_config, ps, sys.argv[1:]))
    model = get_model(run_config, ps, device, toggle)
    optimizer = get_megatron_optimizer(run_config.train, model, ps)
    scheduler = OptimizerParamScheduler.from_train_config(optimizer, run_config.train)
    data = build_data_iterators(run_config, ps, device)
    config = build_schedule_config(run_config, model, ps, toggle)
    tokens = run_config.train.global_batch_size * run_config.model.seq_length
    times: dict[str, list[float]] = {"on": [], "off": []}
    # warm-up off, then on/off/off/on/... (ABBA) so that neither side always runs first.
    plan = ["warmup"] * warmup + [("on", "off", "off", "on")[i % 4] for i in range(2 * steps)]
    try:
        for iteration, side in enumerate(plan, start=1):
            toggle.target = toggle.live if side == "on" else toggle.null
            t0 = time.perf_counter()
            toggle.step_begin(iteration)
            with toggle.range("iteration", "iteration"):
                loss, _, grad_norm = train_step(forward_step, data, model, optimizer, scheduler, config, run_config,
                                                ps, device)
                loss_value = loss.item()
            toggle.step_end(iteration, loss=loss_value, lr=optimizer.param_groups[0]["lr"],
                            grad_norm=float(grad_norm), tokens=tokens, step_time_s=time.perf_counter() - t0)
            if side != "warmup":
                times[side].append(time.perf_counter() - t0)
    except BaseException as exc:
        toggle.live.close(status="failed", error=f"{type(exc).__name__}: {exc}")
        raise
    toggle.live.close(status="complete")
    return times


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    opts, megatron_flags = _options(argv)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = opts.run_dir or os.path.join(tmp, "run")
        run_config = _run_config(opts, megatron_flags, run_dir)
        _init(device, os.path.join(tmp, "store"))
        try:
            times = measure(run_config, device, opts.warmup, opts.steps)
        finally:
            dist.destroy_process_group()
    off, on = statistics.median(times["off"]), statistics.median(times["on"])
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"probe overhead: model {opts.model}, {device} ({name}), global batch {run_config.train.global_batch_size}"
          f" x seq {run_config.model.seq_length}, {opts.steps} steps on / {opts.steps} off after {opts.warmup}"
          " warm-up")
    print(f"  median step time  off {off * 1e3:.2f} ms  on {on * 1e3:.2f} ms  ratio on/off {on / off:.4f}"
          "  (goal <= 1.01)")
    print(f"  command: python {shlex.join(['runs/bench/probe_overhead.py', *argv])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
