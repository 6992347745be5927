"""Run a function on N gloo ranks (CPU processes) and collect what each returns.

`run_distributed(fn, world_size, *args)` spawns world_size processes, initialises a gloo process group over a
file store in a fresh temp dir, calls fn(rank, world_size, *args) in each, and returns the list of results
(index = rank). A failure on any rank raises with that rank's traceback. fn must be importable (module level).
"""
from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from typing import Any, Callable

import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, store_path: str, out_dir: str, fn: Callable, args: tuple) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    try:
        result: Any = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - shipped back to the parent with the traceback
        result = ("error", traceback.format_exc())
    with open(os.path.join(out_dir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any) -> list[Any]:
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        mp.start_processes(_worker, args=(world_size, store, tmp, fn, args), nprocs=world_size, join=True,
                           start_method="spawn")
        results = []
        for rank in range(world_size):
            with open(os.path.join(tmp, f"rank{rank}.pkl"), "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            results.append(value)
        return results
