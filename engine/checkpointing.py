"""Checkpoints: --save / --save-interval / --load / --exit-interval, and resume that continues bit for bit.

Format: one `torch.save` file per rank, DIR/iter_0000005/rank_00003.pt, not torch.distributed.checkpoint. What a
rank holds is flat: its model chunks' DDP param buffers, and its optimizer pieces (main params, Adam's m and v), which
the distributed optimizer cuts at byte ranges of buckets, across parameter edges. DCP's value is resharding, and that
needs each tensor described as a slice of a global one (DTensor / ShardedTensor metadata) that these flat shards do
not have; saved under rank-unique keys DCP would reshard nothing and add a planning collective to every save and load.
So a checkpoint loads only at the layout it was saved at, which common.config.check_load_layout checks before any
rank starts (resharding is not supported), and a rank's save is one sequential write with no collective but the
barriers below (and the parameter all-gather that --overlap-param-gather still owes).

A rank's file holds: the param buffers (padding included, so the bytes are exactly the run's), the optimizer's fp32
main-param copy when the params are 16-bit (fp32 main params are the param buffer itself) and torch's AdamW state
(m, v, step, the param groups' lr), the scheduler's step count, the RNG states (torch CPU, CUDA, Python's random;
not numpy's global one, which nothing draws from: the datasets seed their own RandomState), the data iterators'
positions and the iteration.

Atomic, as Megatron's protocol: every rank writes into DIR/iter_X.tmp; after a barrier rank 0 writes layout.json
there (its presence marks a whole save), renames the directory to iter_X and only then rewrites
latest_checkpointed_iteration.txt (through a temporary file and os.replace). A kill at any point leaves the pointer
naming the previous complete checkpoint; a stale .tmp is removed by the next save. DIR must be one file system
seen by every rank, as Megatron's --save.

Probes (the run's probe set, which the engine hands every DDP chunk): a "checkpoint" range around each save and load,
and a "checkpoint" event per rank (probes.probe_set): a save's iteration, this rank's file size on disk, the seconds
the training loop waited (the whole save is blocking: no asynchronous part), this rank's torch.save alone, and the
iteration this run resumed from; a load's iteration and seconds. The ledger predicts the size
(ledger.formulas.checkpoint).
"""
from __future__ import annotations

import json
import os
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common.config import (
    CHECKPOINT_LAYOUT_FILE,
    LATEST_CHECKPOINT_FILE,
    RunConfig,
    checkpoint_dir_name,
    checkpoint_layout,
    latest_checkpoint,
)
from common.errors import UserError
from engine.optimizer.optimizer import _copy_pieces
from probes.probe_set import NullProbeSet


def _rank_file(directory: Path) -> Path:
    return directory / f"rank_{dist.get_rank():05d}.pt"


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state_all(state["cuda"])


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


@dataclass
class Checkpointer:
    """Saves and loads one rank's training state; the training loop calls load() once and after_step() each step."""
    run_config: RunConfig
    model: list[Any]  # DistributedDataParallel chunks
    optimizer: Any  # MegatronOptimizer
    scheduler: Any  # OptimizerParamScheduler
    data_iterators: list[Any]  # MockDataIterator, one per chunk
    log: bool  # rank 0 prints what it saved and loaded
    probes: Any = field(default_factory=NullProbeSet)  # times each save / load and records what it wrote
    loaded_iteration: int | None = None  # the checkpoint load() restored (None: the run started fresh)

    @property
    def _buffers(self) -> list[torch.Tensor]:
        return [buffer.param_data for chunk in self.model for buffer in chunk.buffers]

    def _state(self, iteration: int) -> dict[str, Any]:
        return {"iteration": iteration, "param_buffers": self._buffers,
                "main_param_storage": self.optimizer.main_param_storage,
                "adam": self.optimizer.optimizer.state_dict(),
                "scheduler_num_steps": self.scheduler.num_steps, "rng": _rng_state(),
                "data_positions": [it.position for it in self.data_iterators]}

    def save(self, iteration: int) -> None:
        start = time.perf_counter()
        with self.probes.range(f"save checkpoint iter {iteration}", "checkpoint", iteration=iteration):
            path, write_seconds = self._save(iteration)
        self.probes.checkpoint("save", iteration=iteration, path=str(path), bytes=path.stat().st_size,
                                seconds=time.perf_counter() - start, write_seconds=write_seconds,
                                loaded_iteration=self.loaded_iteration)

    def _save(self, iteration: int) -> tuple[Path, float]:
        """Write the checkpoint; returns this rank's file (after the rename) and its torch.save's seconds."""
        save_dir = Path(self.run_config.checkpoint.save)
        final = save_dir / checkpoint_dir_name(iteration)
        tmp = final.with_name(final.name + ".tmp")
        for chunk in self.model:  # under --overlap-param-gather the last update's all-gather is still owed
            chunk.start_param_sync(force_sync=True)
        if dist.get_rank() == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
            tmp.mkdir(parents=True)
        dist.barrier()
        write_start = time.perf_counter()
        torch.save(self._state(iteration), _rank_file(tmp))
        write_seconds = time.perf_counter() - write_start
        dist.barrier()
        if dist.get_rank() == 0:
            (tmp / CHECKPOINT_LAYOUT_FILE).write_text(json.dumps(checkpoint_layout(self.run_config), indent=1))
            shutil.rmtree(final, ignore_errors=True)  # a save of this iteration whose pointer was never written
            os.rename(tmp, final)
            _write_atomically(save_dir / LATEST_CHECKPOINT_FILE, f"{iteration}\n")
        dist.barrier()
        if self.log:
            print(f"train-ledger: saved checkpoint {final} at iteration {iteration}", flush=True)
        return _rank_file(final), write_seconds

    def load(self) -> int:
        """Restore what --load and its options ask for; returns the iteration to continue after (0: from scratch)."""
        c = self.run_config.checkpoint
        if c.load is None:
            return 0
        iteration = latest_checkpoint(c.load)
        if iteration is None:
            if self.log:
                print(f"train-ledger: --load {c.load} holds no checkpoint ({LATEST_CHECKPOINT_FILE}): "
                      "training from scratch", flush=True)
            return 0
        start, loaded = time.perf_counter(), iteration
        with self.probes.range(f"load checkpoint iter {loaded}", "checkpoint", iteration=loaded):
            iteration = self._load(loaded)
        self.probes.checkpoint("load", iteration=loaded, finetune=c.finetune, seconds=time.perf_counter() - start,
                                path=str(_rank_file(Path(c.load) / checkpoint_dir_name(loaded))))
        return iteration

    def _load(self, iteration: int) -> int:
        """Restore checkpoint `iteration`; returns the iteration to continue after."""
        c = self.run_config.checkpoint
        self.loaded_iteration = iteration
        directory = Path(c.load) / checkpoint_dir_name(iteration)
        state = torch.load(_rank_file(directory), map_location="cpu", weights_only=True)
        self._load_params(state["param_buffers"], directory)
        if c.finetune or c.no_load_optim:
            _copy_pieces(self.optimizer.main_params, self.optimizer.model_params)  # a fresh optimizer's start
        else:
            if self.optimizer.main_param_storage is not None:
                self.optimizer.main_param_storage.copy_(state["main_param_storage"])
            self.optimizer.optimizer.load_state_dict(state["adam"])
            self.scheduler.num_steps = state["scheduler_num_steps"]
            self.scheduler.step(0)
        if not (c.finetune or c.no_load_rng):
            _set_rng_state(state["rng"])
        if c.finetune:
            iteration = 0
        else:
            for it, position in zip(self.data_iterators, state["data_positions"], strict=True):
                it.position = position
        if self.log:
            print(f"train-ledger: loaded checkpoint {directory}" + (" (params only: --finetune)" if c.finetune
                                                                      else f", continuing after iteration {iteration}"),
                  flush=True)
        return iteration

    def _load_params(self, saved: list[torch.Tensor], directory: Path) -> None:
        buffers = self._buffers
        shapes = [tuple(b.shape) for b in buffers], [tuple(b.shape) for b in saved]
        if shapes[0] != shapes[1]:  # check_load_layout compares the layouts up front; this is the last guard
            raise UserError(f"{directory}: param buffers of shapes {shapes[1]} do not fit this rank's {shapes[0]}")
        with torch.no_grad():
            for buffer, value in zip(buffers, saved):
                buffer.copy_(value)

    def after_step(self, iteration: int) -> bool:
        """Save if due (every --save-interval, at --exit-interval and after the last iteration, as Megatron);
        returns True when training stops here under --exit-interval."""
        c, train_iters = self.run_config.checkpoint, self.run_config.train.train_iters
        exiting = c.exit_interval is not None and iteration % c.exit_interval == 0 and iteration < train_iters
        due = (c.save_interval is not None and iteration % c.save_interval == 0) or exiting or iteration == train_iters
        if c.save is not None and due:
            self.save(iteration)
        if exiting and self.log:
            print(f"train-ledger: exiting after iteration {iteration} (--exit-interval {c.exit_interval})", flush=True)
        return exiting
