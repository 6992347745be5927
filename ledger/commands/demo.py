"""`train-ledger demo`: the main job on whatever machine this is.

First version: an instrumented tiny run through the same launcher as `train-ledger train`. On the CPU that is 4
gloo ranks, TP2 x DP2 with sequence parallelism; with GPUs it is one rank per GPU, TP2 where there are two or more.
It prints the rank layout, the engine's per-step log, and the loss curve read back from the run directory.
"""
from __future__ import annotations

import time
from pathlib import Path

from ledger.commands._args import CommandParser

CPU_RANKS = 4


def layout(device_count: int) -> tuple[int, int]:
    """(world size, TP size) for the machine: 4 CPU ranks without GPUs, else one rank per GPU."""
    world = device_count or CPU_RANKS
    return world, 2 if world >= 2 and world % 2 == 0 else 1


def demo_flags(world: int, tp: int, train_iters: int, run_dir: Path) -> list[str]:
    dp = world // tp
    return ["--model", "tiny", "--tensor-model-parallel-size", str(tp), "--sequence-parallel",
            "--micro-batch-size", "2", "--global-batch-size", str(2 * 2 * dp), "--train-iters", str(train_iters),
            "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "2", "--mock-data", "--timers",
            "--log-memory-to-tensorboard", "--run-dir", str(run_dir)]


def print_layout(world: int, tp: int) -> None:
    from engine.parallel_state import group_lists, rank_generator_for

    groups = group_lists(rank_generator_for(world, tp, pp=1))
    print(f"demo: {world} ranks, TP{tp} x DP{world // tp}" + (" with sequence parallelism" if tp > 1 else ""))
    for kind in ("tp", "dp"):
        print(f"  {kind.upper()} groups: {groups[kind]}")


def print_loss(run_dir: Path) -> None:
    from probes.run_dir import iter_events

    losses = [event["loss"] for event in iter_events(run_dir, 0, {"step"})]
    print(f"demo: loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps; run directory {run_dir}")


def main(argv: list[str]) -> int:
    import torch

    from ledger.commands import train

    p = CommandParser("demo", description=__doc__.splitlines()[0])
    p.add_argument("--run-dir", type=Path, help="default: runs/out/demo-<timestamp>")
    p.add_argument("--train-iters", type=int, default=20)
    a = p.parse_args(argv)
    run_dir = a.run_dir or Path("runs/out") / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    world, tp = layout(torch.cuda.device_count() if torch.cuda.is_available() else 0)
    print_layout(world, tp)
    status = train.main(["--nproc-per-node", str(world), *demo_flags(world, tp, a.train_iters, run_dir)])
    if status == 0:
        print_loss(run_dir)
    return status
