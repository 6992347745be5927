"""`train-ledger train [Megatron flags] --run-dir RUN`: run the engine under torchrun, or launch torchrun.

Under torchrun (RANK in the environment) this process is one rank and runs the engine in-process. Otherwise it
launches `python -m torch.distributed.run ... -m engine.train <flags>` with --nproc-per-node processes per node (1 by
default): on one node with a free port chosen by torchrun (--standalone) unless --master-port is given; across nodes
with a c10d rendezvous at --rdzv-endpoint (the first node), one launcher per node, as runs/slurm/train.sbatch does.
The flags are validated here, for the whole world, before any process starts: bad input is one line and status 2.
"""
from __future__ import annotations

import os
import subprocess
import sys

from cli.args import CommandParser
from common.errors import ConfigError


def launcher_parser() -> CommandParser:
    p = CommandParser("train", add_help=False)
    p.add_argument("--nproc-per-node", type=int)
    p.add_argument("--nnodes", type=int, default=1)
    p.add_argument("--node-rank", type=int, default=0)
    p.add_argument("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous (the first node); needed with --nnodes > 1")
    p.add_argument("--rdzv-id", default="train-ledger", help="the job's id, the same on every node")
    p.add_argument("--master-port", type=int, help="a fixed port on this host instead of a free one (one node)")
    return p


def torchrun_command(launch, module: str, argv: list[str]) -> list[str]:
    """`python -m torch.distributed.run ... -m MODULE ARGV` for the launch flags in `launch` (launcher_parser's)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(launch.nproc_per_node),
           "--nnodes", str(launch.nnodes), "--max-restarts", "0"]
    if launch.rdzv_endpoint:
        cmd += ["--node-rank", str(launch.node_rank), "--rdzv-backend", "c10d",
                "--rdzv-endpoint", launch.rdzv_endpoint, "--rdzv-id", launch.rdzv_id]
    elif launch.master_port is not None:
        cmd += ["--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port", str(launch.master_port)]
    else:
        cmd += ["--standalone"]
    return cmd + ["-m", module, *argv]


def check_launch(launch) -> None:
    if launch.nproc_per_node < 1:
        raise ConfigError(f"--nproc-per-node must be >= 1, got {launch.nproc_per_node}")
    if launch.nnodes < 1 or not 0 <= launch.node_rank < launch.nnodes:
        raise ConfigError(f"--node-rank {launch.node_rank} is outside --nnodes {launch.nnodes}")
    if launch.nnodes > 1 and not launch.rdzv_endpoint:
        raise ConfigError(f"--nnodes {launch.nnodes} needs --rdzv-endpoint HOST:PORT (the first node)")
    if launch.rdzv_endpoint and launch.master_port is not None:
        raise ConfigError("--rdzv-endpoint and --master-port are alternatives; give one")


def main(argv: list[str]) -> int:
    from common.arguments import build_parser, parse_args

    if "-h" in argv or "--help" in argv:
        launcher_parser().print_help()
        build_parser().print_help()
        return 0
    launch, engine_argv = launcher_parser().parse_known_args(argv)
    if launch.nproc_per_node is None and "RANK" in os.environ:
        from engine.train import main as engine_main
        return engine_main(engine_argv)
    launch.nproc_per_node = launch.nproc_per_node or 1
    check_launch(launch)
    parse_args(engine_argv, world_size=launch.nproc_per_node * launch.nnodes)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(torchrun_command(launch, "engine.train", engine_argv), env=env)
