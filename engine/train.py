"""`python -m engine.train [Megatron flags]`: one rank of a torchrun-launched run.

torchrun sets RANK, LOCAL_RANK, WORLD_SIZE and the rendezvous; this module turns them into a process group (NCCL
with one device per LOCAL_RANK when CUDA is present, gloo on the CPU), the flags into a RunConfig, and runs pretrain
under the probes facade. Bad flags are one line on stderr from rank 0 and exit status 2 on every rank; any other
failure marks the run directory's manifest failed, with the error, before it propagates. A rank dies with its
launcher and turns SIGTERM / SIGINT into a failed run (common.process).
"""
from __future__ import annotations

import gc
import os
import signal
import sys

import torch
import torch.distributed as dist

from common.arguments import parse_args
from common.config import RunConfig
from common.errors import ConfigError, UserError
from common.process import Terminated, die_with_parent, raise_on_termination, stopped_by
from common.wording import plural


def set_deterministic_mode() -> None:
    """Megatron's --deterministic-mode. cuBLAS picks reduction orders that depend on its workspace unless the
    workspace is fixed (before its first handle), and some torch kernels (the embedding's backward, index_add) sum
    with atomics unless told to sort first; with both pinned, two runs of the same flags give the same bits, which
    is what a bit-exact resume on GPU needs (docs/engine.md, "Checkpoints")."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)


def init_distributed() -> torch.device:
    """Join torchrun's process group; returns this rank's device."""
    if torch.cuda.is_available():
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device)
        return device
    dist.init_process_group("gloo")
    return torch.device("cpu")


def run(run_config: RunConfig, argv: list[str], device: torch.device) -> None:
    from engine.parallel_state import ParallelState
    from engine.training import pretrain
    from probes.probe_set import create_probe_set

    p = run_config.parallel
    parallel_state = ParallelState.from_run_config(run_config)
    torch.manual_seed(run_config.train.seed)
    if parallel_state.rank == 0:
        print(f"train-ledger: world {p.world_size} = tp {parallel_state.tp_size} x cp {parallel_state.cp_size} x "
              f"dp {parallel_state.dp_size} x pp {parallel_state.pp_size} (ep {parallel_state.ep_size}) on "
              f"{device.type}, "
              f"{plural(run_config.num_microbatches, 'micro-batch')} of {run_config.train.micro_batch_size} per step",
              flush=True)
    probes = create_probe_set(run_config, parallel_state, argv)
    try:
        pretrain(run_config, parallel_state, device, probes, log=parallel_state.rank == 0)
    except BaseException as exc:
        try:
            probes.close(status="failed", error=failure(exc))
        except Terminated:  # the stop landed while recording; it is raised once, so this second record completes
            probes.close(status="failed", error=failure(exc))
        raise
    probes.close(status="complete")


def failure(exc: BaseException) -> str:
    """The manifest's error: the stop signal when one arrived (a peer's hang-up it caused is not the cause)."""
    stop = stopped_by()
    return f"Terminated: stopped by {stop}" if stop is not None else f"{type(exc).__name__}: {exc}"


def say(line: str) -> None:
    """One line on stderr in one write: every rank may say the same at once into torchrun's pipe, and print's two
    writes (the text, then the newline; unbuffered under torchrun) interleaved them into one garbled line."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    die_with_parent()  # torchrun's agent: if it is killed outright, this rank must not run on
    raise_on_termination()  # SIGTERM from torchrun (or the kernel) -> the run is recorded as failed
    try:
        run_config = parse_args(argv, world_size=int(os.environ.get("WORLD_SIZE", 1)))
    except ConfigError as exc:
        if int(os.environ.get("RANK", 0)) == 0:
            say(f"train-ledger train: error: {exc}")
        return 2
    if run_config.train.deterministic_mode:
        set_deterministic_mode()
    device = init_distributed()
    try:
        run(run_config, argv, device)
    except UserError as exc:  # found only once the ranks run (an existing --run-dir, say): still one line
        say(f"train-ledger train: error: {exc}")  # the launcher relays one
        return 2
    except BaseException:
        if stopped_by() is None:
            raise
        if dist.get_rank() == 0:
            say(f"train-ledger train: stopped by {stopped_by()}; the run is marked failed")
        return 128 + signal.SIGTERM
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    status = main()
    # The interpreter's collections at exit walk every object torch made (300,000 in a CPU rank): 4 of the demo's 6 s
    # between its last step and the launcher's return. Everything is written and closed by now; nothing is left
    # whose cycles need collecting, so they are frozen out of those walks.
    gc.freeze()
    sys.exit(status)
