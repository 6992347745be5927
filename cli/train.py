"""`train-ledger train [Megatron flags] --run-dir RUN`: run the engine under torchrun, or launch torchrun.

Under torchrun (RANK in the environment) this process is one rank and runs the engine in-process. Otherwise it
launches `python -m torch.distributed.run ... -m engine.train <flags>` with --nproc-per-node processes per node (1 by
default): on one node with a free port chosen by torchrun (--standalone) unless --master-port is given; across nodes
with a c10d rendezvous at --rdzv-endpoint (the first node), one launcher per node, as runs/slurm/train.sbatch does.
The flags are validated here, for the whole world, before any process starts: bad input is one line and status 2.
"""
from __future__ import annotations

import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, TextIO

from cli.args import CommandParser, help_wanted, print_help
from common.errors import ConfigError, InputError
from common.process import die_with_parent
from common.run_dir import LEDGER_DIR, MANIFEST, check_writable, now_iso, read_manifest, update_manifest

CHILD_FAILED = "torch.distributed.elastic.multiprocessing.errors.ChildFailedError"
SIGNALLED = "torch.distributed.elastic.multiprocessing.api.SignalException"
CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
RANK_ERROR = "train-ledger train: error: "  # engine.train's one line for bad input found by a rank
RANK_STOPPED = "train-ledger train: stopped by "  # engine.train's line for a rank that SIGTERM or SIGINT stopped
TORCHRUN_LOG = re.compile(r"[DIWE]\d{4} [\d:.]+ \d+ \S*torch/distributed/")  # its logger: W1201 21:05:42.349 4021 ...


def launcher_parser() -> CommandParser:
    p = CommandParser("train", add_help=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc-per-node", type=int, help="ranks on this node (default 1; under torchrun: its own)")
    p.add_argument("--nnodes", type=int, default=1, help="nodes, one launcher on each (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="this node's place among --nnodes (default 0)")
    p.add_argument("--rdzv-endpoint",
                   help="HOST:PORT of the c10d rendezvous (the first node); needed with --nnodes > 1")
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
    if launch.master_port is not None and not 1 <= launch.master_port <= 65535:
        raise ConfigError(f"--master-port {launch.master_port}: expected 1..65535")


def main(argv: list[str], say_next: bool = True) -> int:
    """`say_next`: end by saying where the run went and the commands that read it (the demo runs them itself)."""
    from common.arguments import build_parser, parse_args
    from common.config import check_engine_support

    if help_wanted(argv):
        print_help(launcher_parser(), build_parser())
        return 0
    launch, engine_argv = launcher_parser().parse_known_args(argv)
    if launch.nproc_per_node is None and "RANK" in os.environ:
        from engine.train import main as engine_main
        return engine_main(engine_argv)
    launch.nproc_per_node = 1 if launch.nproc_per_node is None else launch.nproc_per_node
    check_launch(launch)
    run_config = parse_args(engine_argv, world_size=launch.nproc_per_node * launch.nnodes)
    check_engine_support(run_config)
    if run_config.train.data_path is not None:  # a missing .idx, a truncated .bin, ids beyond the vocab: now;
        from engine.datasets.builder import check_data  # and the index caches the ranks will read, written once

        check_data(run_config)
    run_dir = run_config.probes.run_dir
    if run_dir is not None:
        check_new_run_dir(Path(run_dir))
    check_output_dirs({"--run-dir": run_dir, "--save": run_config.checkpoint.save,
                       "--tensorboard-dir": run_config.probes.tensorboard_dir})
    gpu_bytes = _gpu_total_bytes()
    for needs_gpu, flag in ((run_config.implementation.graphed_layers, "--cuda-graph-impl local"),
                            (run_config.implementation.fused_attention, "--attention-backend fused")):
        if needs_gpu and gpu_bytes is None:
            raise ConfigError(f"{flag} needs CUDA GPUs; this machine has none (NVML finds no device)")
    if run_config.implementation.fp8 and importlib.util.find_spec("torchao") is None:
        raise ConfigError("--fp8-format needs torchao, which is not installed: pip install -e '.[fp8]'")
    check_fits(run_config, launch.nproc_per_node, gpu_bytes)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "1")
    if run_dir is None:
        print("train-ledger train: no --run-dir: nothing is recorded beyond the lines below (add --run-dir DIR to "
              "reconcile, report and open the run in the dashboard)", flush=True)
    done = supervise(torchrun_command(launch, "engine.train", engine_argv), env)
    if run_dir is not None and done.status != 0:
        mark_failed(Path(run_dir), done.stopped_by or f"the ranks exited with status {done.status}")
    if run_dir is not None and done.status == 0 and say_next:
        print("\n".join(next_steps(Path(run_dir))), flush=True)
    return 2 if done.status != 0 and done.rank_errors else done.status


def next_steps(run_dir: Path) -> list[str]:
    """Where a finished run went and the commands that read it, each runnable as printed."""
    run = shlex.quote(str(run_dir))
    return [f"train-ledger train: the run is recorded in {run_dir}; next:",
            f"  train-ledger reconcile {run}      # formula | inventory | measurement, row by row",
            f"  train-ledger report {run}         # {run_dir / LEDGER_DIR}/report.md and report.html",
            f"  train-ledger dashboard --runs-root {shlex.quote(str(run_dir.parent))} "
            f"--run {shlex.quote(run_dir.name)}"]


def check_fits(run_config, ranks_here: int, gpu_bytes: int | None) -> None:
    """Refuse, before any rank starts, a run whose planned peak memory cannot fit: on the CPU the ranks of this node
    share its RAM; on GPUs each rank needs its plan's peak on its own device (`gpu_bytes`: NVML's total, read without
    creating a CUDA context in this launcher; None without a GPU). The plan's peak leaves out what it cannot know
    (allocator cache, CUDA context), so only what cannot fit even then is refused; a tight fit is left to the run."""
    from ledger.models.plan import build_plan

    peak = max(build_plan(run_config)["memory"]["peak_bytes_per_stage"])
    if gpu_bytes is not None and peak > gpu_bytes:
        raise ConfigError(f"the plan's peak memory per rank is {peak / 2**30:,.1f} GiB; this machine's GPUs hold "
                          f"{gpu_bytes / 2**30:,.1f} GiB (see `train-ledger plan` with the same flags)")
    ram = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if gpu_bytes is None and peak * ranks_here > ram:
        raise ConfigError(f"the plan's peak memory is {peak / 2**30:,.1f} GiB per rank x {ranks_here} ranks on this "
                          f"node; it has {ram / 2**30:,.1f} GiB of RAM (see `train-ledger plan` with the same flags)")


def _gpu_total_bytes() -> int | None:
    """Memory of GPU 0 from NVML, None without a GPU or NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0)).total)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - ImportError or any NVMLError (no driver, no device): no GPU to check against
        return None


def check_new_run_dir(run_dir: Path) -> None:
    """Refuse an existing run before any rank starts (the ranks would find it only after start-up)."""
    if (run_dir / MANIFEST).exists():
        raise ConfigError(f"--run-dir {run_dir}: already holds a run ({MANIFEST}); choose a new directory")
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"--run-dir {run_dir}: is a file")


def check_output_dirs(folders: dict[str, str | None]) -> None:
    """Every folder the ranks will write must take a file now: a read-only mount or a path under a file would
    otherwise fail in every rank at start-up, or (--save) after a step has trained, as a rank's OSError and a lost
    peer. The check leaves nothing behind (common.run_dir.check_writable)."""
    for flag, folder in folders.items():
        if folder is None:
            continue
        try:
            check_writable(Path(folder) / ".write-check")
        except InputError as exc:
            raise ConfigError(f"{flag} {folder}: {exc.problem}") from None


@dataclass
class Supervised:
    status: int  # torchrun's exit status
    stopped_by: str | None  # the signal that stopped the launcher, if one did
    rank_errors: list[str] = field(default_factory=list)  # the ranks' one-line errors (bad input found by a rank)


def supervise(cmd: list[str], env: dict[str, str]) -> Supervised:
    """Run torchrun as a child that dies with this launcher, forwarding SIGINT and SIGTERM to it (torchrun stops
    its ranks on either)."""
    parent = os.getpid()
    child = subprocess.Popen(cmd, env=env, stderr=subprocess.PIPE, text=True, bufsize=1,
                             preexec_fn=lambda: die_with_parent(parent))
    rank_errors: list[str] = []
    relay = threading.Thread(target=relay_stderr, args=(child.stderr, sys.stderr, rank_errors), daemon=True)
    relay.start()
    stopped_by: list[str] = []

    def forward(signum: int, _frame: object) -> None:
        stopped_by.append(f"the launcher received {signal.Signals(signum).name}")
        child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        status = child.wait()
        relay.join()
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return Supervised(status, stopped_by[0] if stopped_by else None, rank_errors)


def relay_stderr(lines: Iterable[str], out: TextIO, rank_errors: list[str] | None = None) -> None:
    """Copy torchrun's stderr (the ranks' own lines included) but not torchrun's Python traceback: that is the
    launcher's plumbing, not the user's problem. torchrun's exception becomes one line (the last of a chain of
    tracebacks), or none when it only says that a rank failed or that it was signalled. A rank reports bad input in
    one line (RANK_ERROR), collected into `rank_errors`; only the first reaches the user: the other ranks repeat it
    or fail of it, and torchrun's log of stopping them, or a rank's word that SIGTERM stopped it, follows from it."""
    rank_errors = [] if rank_errors is None else rank_errors
    state = "copy"  # copy | traceback (inside one) | after (its exception line seen: a chain may follow)
    error = ""
    box_rules = 0  # the failure report after ChildFailedError: a box between two lines of '='; 0 = no box
    for line in lines:
        if box_rules:
            box_rules += line.startswith("=" * 20)
            box_rules = 0 if box_rules > 2 else box_rules
            continue
        if line.startswith("Traceback (most recent call last):"):
            state = "traceback"
            continue
        if state == "traceback":
            if not line.startswith((" ", "\t")):
                state, error = "after", line.strip()
            continue
        if state == "after":
            if not line.strip() or line.startswith(CHAINED):
                continue
            state, box_rules = "copy", _report_error(error, out)
            if box_rules:
                continue
        if rank_errors and (line.startswith((RANK_ERROR, RANK_STOPPED)) or TORCHRUN_LOG.match(line)):
            continue
        if line.startswith(RANK_ERROR):
            rank_errors.append(line.strip())
        out.write(line)
        out.flush()
    if state == "after":
        _report_error(error, out)


def _report_error(error: str, out: TextIO) -> int:
    """One line for torchrun's own exception unless it only says a rank failed (returns 1: its report box follows,
    to be dropped) or that torchrun was signalled."""
    if error.startswith(CHILD_FAILED):
        return 1
    if SIGNALLED not in error:
        print(f"train-ledger train: torchrun: {error}", file=out, flush=True)
    return 0


def mark_failed(run_dir: Path, why: str) -> None:
    """A run whose ranks did not finish is failed; the ranks record it themselves when they can, this covers the
    ranks that could not (killed outright) without overwriting what they wrote."""
    try:
        manifest = read_manifest(run_dir)
    except InputError:
        return  # no run was started (bad flags caught by the ranks, or a start-up failure before the manifest)
    if manifest["status"] == "running":
        update_manifest(run_dir, status="failed", error=why, ended=now_iso())
