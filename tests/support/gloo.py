"""Run a function on N gloo ranks (CPU processes) and collect what each returns.

`run_distributed(fn, world_size, *args)` starts world_size processes in one gloo group, calls fn(rank, world_size,
*args) in each and returns the results by rank; a failure on any rank raises with that rank's traceback. fn must be
importable (module level), as it is pickled by name.

The processes are forked from a forkserver that has imported torch once for the whole test session: a spawned
process spends seconds importing torch, which on a 2-core machine was most of a gloo test's time. The forkserver is a
fresh interpreter that imported nothing else (in particular nothing of the engine, whose module state, such as
engine.checkpointing's start-up clock, each rank imports afresh), and each rank takes the caller's current
environment and directory, so a rank starts as a spawned one would, only sooner."""
from __future__ import annotations

import contextlib
import os
import pickle
import tempfile
import traceback
from typing import Any, Callable, Iterator

# What the forkserver imports before it forks a rank: what every rank imports first, and nothing with state of ours.
PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]


def _worker(rank: int, world_size: int, tmp: str, fn: Callable, args: tuple, env: dict[str, str], cwd: str) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=rank,
                            world_size=world_size)
    try:
        result: tuple[str, Any] = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - reported by the parent with this rank's traceback
        result = ("error", traceback.format_exc())
    with open(os.path.join(tmp, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    # Every rank reaches here before any leaves, so no peer sees a connection drop mid-collective; then leave
    # without interpreter teardown: the result is on disk, and gloo's C++ destructors at shutdown can abort the
    # process ("terminate called without an active exception") on a loaded machine, failing a finished run.
    if result[0] == "ok":
        dist.barrier()
    os._exit(0)


def run_distributed(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    """fn(rank, world_size, *args) on world_size CPU processes in one gloo group; results by rank."""
    import multiprocessing

    import torch.multiprocessing as mp

    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)  # no effect once it runs
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_worker, args=(world_size, tmp, fn, args, dict(os.environ), os.getcwd()),
                           nprocs=world_size, join=True, start_method="forkserver")
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results


@contextlib.contextmanager
def world_of_one() -> Iterator[None]:
    """A gloo process group of this process alone, for single-process tests of what needs one (DDP, the optimizers,
    a reference run); destroyed on exit."""
    import torch.distributed as dist

    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}", rank=0, world_size=1)
        try:
            yield
        finally:
            dist.destroy_process_group()
