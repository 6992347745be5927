"""Checkpoints: --save / --save-interval / --load / --exit-interval, and resume that continues bit for bit.

The details: docs/engine.md, "The format and the save protocol".
"""
from __future__ import annotations

import json
import os
import random
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_flatten, tree_unflatten

from common.config import (
    CHECKPOINT_LAYOUT_FILE,
    LATEST_CHECKPOINT_FILE,
    RunConfig,
    checkpoint_dir_name,
    checkpoint_layout,
    latest_checkpoint,
    layout_differences,
)
from common.errors import UserError
from common.wording import plural
from engine.checkpoint_reshard import load_rank_file, resharded_state, resharding_note
from engine.optimizer.optimizer import _copy_pieces
from probes.probe_set import NullProbeSet
from probes.protocol import ProbeSetProtocol

SAVED_BY_RUN_DIR = "saved_by_run_dir"  # layout.json's key for the run directory that saved the checkpoint
POLL_SECONDS = 0.01  # how often rank 0's finaliser looks for the other ranks' files
# The rank's start, which --exit-duration-in-mins counts from: as Megatron's _TRAIN_START_TIME, taken when the
# training module is imported, so model building and the start-up sweeps count against the job's allotted time.
PROCESS_STARTED = time.monotonic()


def _rank_file(directory: Path, rank: int | None = None) -> Path:
    return directory / f"rank_{dist.get_rank() if rank is None else rank:05d}.pt"


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if state["cuda"] is not None:
        torch.cuda.set_rng_state_all(state["cuda"])


def _agreed(read: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """`read()` on every rank, and every rank stops if any rank's read failed, with that rank's message (the lowest
    such rank's): a rank whose own file is fine would otherwise train on and die later of the lost peer, and the run
    would record that instead of the file that stopped it."""
    try:
        state, problem = read(), None
    except UserError as exc:
        state, problem = None, str(exc)
    problems = [problem]
    if dist.is_initialized() and dist.get_world_size() > 1:
        problems = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
    failed = [text for text in problems if text is not None]
    if failed:
        others = f" (the files of {plural(len(failed) - 1, 'other rank')} fail too)" if len(failed) > 1 else ""
        raise UserError(failed[0] + others)
    return state


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _wait_for_rank_files(directory: Path, world_size: int) -> None:
    """Until every rank's file is in `directory` (each appears by rename, whole)."""
    while sum(1 for _ in directory.glob("rank_*.pt")) < world_size:
        time.sleep(POLL_SECONDS)


def _finalise(save_dir: Path, iteration: int, layout: dict[str, Any]) -> None:
    """Rank 0, once every rank's file is in iter_X.tmp: layout.json, the rename to iter_X, then the pointer."""
    final = save_dir / checkpoint_dir_name(iteration)
    tmp = final.with_name(final.name + ".tmp")
    (tmp / CHECKPOINT_LAYOUT_FILE).write_text(json.dumps(layout, indent=1))
    shutil.rmtree(final, ignore_errors=True)  # a save of this iteration whose pointer was never written
    os.rename(tmp, final)
    _write_atomically(save_dir / LATEST_CHECKPOINT_FILE, f"{iteration}\n")


@dataclass
class HostCopy:
    """Host buffers matching a state's tensors, allocated at the first --async-save and reused (the previous save's
    write has finished before the next copy): pinned on CUDA, so the device-to-host copies run at full speed."""
    buffers: list[torch.Tensor] = field(default_factory=list)
    alloc_seconds: float = 0.0  # of the last copy: allocating (pinning) the buffers, 0 when they were reused
    copy_seconds: float = 0.0  # of the last copy: the copies themselves

    def of(self, state: Any) -> Any:
        """`state` with every tensor replaced by its copy in host memory, complete when this returns."""
        leaves, spec = tree_flatten(state)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        start = time.perf_counter()
        if [(b.shape, b.dtype) for b in self.buffers] != [(t.shape, t.dtype) for t in tensors]:
            self.buffers = [torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda) for t in tensors]
        copied = time.perf_counter()
        self.alloc_seconds = copied - start
        for buffer, tensor in zip(self.buffers, tensors):
            buffer.copy_(tensor.detach(), non_blocking=tensor.is_cuda)
        if any(t.is_cuda for t in tensors):
            torch.cuda.synchronize()
        self.copy_seconds = time.perf_counter() - copied
        copies = iter(self.buffers)
        return tree_unflatten([next(copies) if isinstance(x, torch.Tensor) else x for x in leaves], spec)


@dataclass
class PendingSave:
    """One save after its blocking part: writes this rank's file and, on rank 0, finalises the checkpoint; run()
    inline, or start() in a background thread and join() later (which raises what the thread raised)."""
    iteration: int
    state: dict[str, Any]
    save_dir: Path
    layout: dict[str, Any] | None  # rank 0's: what it writes as layout.json; None on the other ranks
    world_size: int
    rank: int
    blocking_seconds: float = 0.0
    waited_seconds: float = 0.0  # of the blocking part: waiting for the previous save's background part to end
    host_alloc_seconds: float = 0.0  # of the blocking part (--async-save): pinning the host buffers (first save)
    host_copy_seconds: float = 0.0  # of the blocking part (--async-save): the device-to-host copy
    background: bool = False
    bytes: int = 0
    write_seconds: float = 0.0
    work_seconds: float = 0.0
    error: BaseException | None = None
    thread: threading.Thread | None = None

    @property
    def tmp(self) -> Path:
        return self.save_dir / (checkpoint_dir_name(self.iteration) + ".tmp")

    def run(self) -> None:
        start = time.perf_counter()
        target = _rank_file(self.tmp, self.rank)
        part = target.with_name(target.name + ".part")
        torch.save(self.state, part)
        self.write_seconds = time.perf_counter() - start
        self.bytes = part.stat().st_size
        os.replace(part, target)
        self.state = {}  # the host copy's buffers stay with the Checkpointer, for the next save
        if self.layout is not None:
            _wait_for_rank_files(self.tmp, self.world_size)
            _finalise(self.save_dir, self.iteration, self.layout)
        self.work_seconds = time.perf_counter() - start

    def start(self) -> None:
        self.background = True
        self.thread = threading.Thread(target=self._run_catching, name=f"checkpoint-{self.iteration}", daemon=True)
        self.thread.start()

    def _run_catching(self) -> None:
        try:
            self.run()
        except BaseException as exc:  # noqa: BLE001 - handed to the training loop's thread by join()
            self.error = exc

    @property
    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def join(self) -> None:
        if self.thread is not None:
            self.thread.join()
        if self.error is not None:
            raise self.error


@dataclass
class Checkpointer:
    """Saves and loads one rank's training state; the training loop calls load() once, after_step() each step and
    finish() at the end (a background save must be on disk before training returns)."""
    run_config: RunConfig
    model: list[Any]  # DistributedDataParallel chunks
    optimizer: Any  # MegatronOptimizer
    scheduler: Any  # OptimizerParamScheduler
    data_iterators: list[Any]  # MockDataIterator, one per chunk
    log: bool  # rank 0 prints what it saved and loaded
    probes: ProbeSetProtocol = field(default_factory=NullProbeSet)  # times each save / load and records what it wrote
    loaded_iteration: int | None = None  # the checkpoint load() restored (None: the run started fresh)
    started: float = PROCESS_STARTED  # time.monotonic() at start-up, which --exit-duration-in-mins counts from
    host_copy: HostCopy = field(default_factory=HostCopy)
    pending: PendingSave | None = None  # the save whose background part may still run

    @property
    def _buffers(self) -> list[torch.Tensor]:
        return [buffer.param_data for chunk in self.model for buffer in chunk.buffers]

    def _state(self, iteration: int) -> dict[str, Any]:
        return {"iteration": iteration, "param_buffers": self._buffers,
                "main_param_storage": self.optimizer.main_param_storage,
                "adam": self.optimizer.optimizer.state_dict(),
                "scheduler_num_steps": self.scheduler.num_steps, "rng": _rng_state(),
                "data_positions": [it.position for it in self.data_iterators]}

    def _layout(self) -> dict[str, Any]:
        """layout.json: what check_load_layout compares, and the run directory that saved it (the dashboard's link
        from a resumed run back to this one)."""
        run_dir = self.run_config.probes.run_dir
        return {**checkpoint_layout(self.run_config),
                SAVED_BY_RUN_DIR: os.path.abspath(run_dir) if run_dir is not None else None}

    def save(self, iteration: int) -> None:
        c, start = self.run_config.checkpoint, time.perf_counter()
        self.finish()  # one save in flight: the previous one's file is written (and on rank 0 finalised) first
        waited = time.perf_counter() - start
        with self.probes.range(f"save checkpoint iter {iteration}", "checkpoint", iteration=iteration):
            pending = self._prepare(iteration)
            if c.async_save:
                pending.state = self.host_copy.of(pending.state)
                pending.host_alloc_seconds = self.host_copy.alloc_seconds
                pending.host_copy_seconds = self.host_copy.copy_seconds
                pending.start()
            else:
                pending.run()
        pending.blocking_seconds, pending.waited_seconds = time.perf_counter() - start, waited
        self.pending = pending
        if not c.async_save:
            self.finish()

    def _prepare(self, iteration: int) -> PendingSave:
        """The blocking start of a save: the owed param sync, rank 0's fresh iter_X.tmp, a barrier."""
        save_dir = Path(self.run_config.checkpoint.save)
        for chunk in self.model:  # under --overlap-param-gather the last update's all-gather is still owed
            chunk.start_param_sync(force_sync=True)
        pending = PendingSave(iteration=iteration, state=self._state(iteration), save_dir=save_dir,
                              layout=self._layout() if dist.get_rank() == 0 else None,
                              world_size=dist.get_world_size(), rank=dist.get_rank())
        if pending.layout is not None:
            shutil.rmtree(pending.tmp, ignore_errors=True)  # left by a save that was killed
            pending.tmp.mkdir(parents=True)
        dist.barrier()
        return pending

    def finish(self, wait: bool = True) -> None:
        """Finish the pending save (wait=False: only if its background part is done): raise what it raised,
        record its event."""
        p = self.pending
        if p is None or (not wait and p.running):
            return
        self.pending = None
        p.join()
        final = Path(self.run_config.checkpoint.save)
        self.probes.checkpoint("save", iteration=p.iteration,
                                path=str(_rank_file(final / checkpoint_dir_name(p.iteration), p.rank)),
                                bytes=p.bytes, blocking_seconds=p.blocking_seconds,
                                waited_for_previous_seconds=p.waited_seconds,
                                host_alloc_seconds=p.host_alloc_seconds, host_copy_seconds=p.host_copy_seconds,
                                background_seconds=p.work_seconds if p.background else 0.0,
                                write_seconds=p.write_seconds, async_save=p.background,
                                loaded_iteration=self.loaded_iteration)
        if self.log:
            where = "" if not p.background else f" (in the background: {p.work_seconds:.3g} s)"
            print(f"train-ledger: saved checkpoint {final / checkpoint_dir_name(p.iteration)} at iteration "
                  f"{p.iteration}{where}", flush=True)

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
        directory = Path(c.load) / checkpoint_dir_name(loaded)
        saved_by = json.loads((directory / CHECKPOINT_LAYOUT_FILE).read_text()).get(SAVED_BY_RUN_DIR)
        self.probes.checkpoint("load", iteration=loaded, finetune=c.finetune, seconds=time.perf_counter() - start,
                                path=str(_rank_file(directory)), saved_by_run_dir=saved_by)
        return iteration

    def _load(self, iteration: int) -> int:
        """Restore checkpoint `iteration`; returns the iteration to continue after."""
        c = self.run_config.checkpoint
        self.loaded_iteration = iteration
        directory = Path(c.load) / checkpoint_dir_name(iteration)
        state = _agreed(lambda: self._read_state(directory, with_optimizer=not (c.finetune or c.no_load_optim)))
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

    def _read_state(self, directory: Path, with_optimizer: bool) -> dict[str, Any]:
        """This rank's file; or, from a checkpoint of another layout (check_load_layout lets only reshardable keys
        differ), the state this rank would have saved, resharded (engine.checkpoint_reshard)."""
        saved_layout = json.loads((directory / CHECKPOINT_LAYOUT_FILE).read_text())
        if not layout_differences(self.run_config, saved_layout):
            return load_rank_file(_rank_file(directory))
        if self.log:
            print(resharding_note(self.run_config, saved_layout, directory.name), flush=True)
        return resharded_state(self.run_config, saved_layout, lambda rank: _rank_file(directory, rank), self.model,
                               self.optimizer, with_optimizer=with_optimizer)

    def _load_params(self, saved: list[torch.Tensor], directory: Path) -> None:
        buffers = self._buffers
        shapes = [tuple(b.shape) for b in buffers], [tuple(b.shape) for b in saved]
        if shapes[0] != shapes[1]:  # check_load_layout compares the layouts up front; this is the last guard
            raise UserError(f"{directory}: param buffers of shapes {shapes[1]} do not fit this rank's {shapes[0]}")
        with torch.no_grad():
            for buffer, value in zip(buffers, saved):
                buffer.copy_(value)

    def after_step(self, iteration: int) -> bool:
        """Save if due (every --save-interval, at --exit-interval or --exit-duration-in-mins, and after the last
        iteration, as Megatron); returns True when training stops here early."""
        c, train_iters = self.run_config.checkpoint, self.run_config.train.train_iters
        self.finish(wait=False)  # a background save that has ended: its event now, its error now
        by_interval = c.exit_interval is not None and iteration % c.exit_interval == 0
        exiting = iteration < train_iters and (by_interval or self._out_of_time())
        due = (c.save_interval is not None and iteration % c.save_interval == 0) or exiting or iteration == train_iters
        if c.save is not None and due:
            self.save(iteration)
        if exiting and self.log:
            why = (f"--exit-interval {c.exit_interval}" if by_interval
                   else f"--exit-duration-in-mins {c.exit_duration_in_mins:g}")
            print(f"train-ledger: exiting after iteration {iteration} ({why})", flush=True)
        return exiting

    def _out_of_time(self) -> bool:
        """Whether any rank has trained --exit-duration-in-mins: each rank's own clock, all-reduced with MAX (as
        Megatron), so that every rank stops after the same iteration."""
        minutes = self.run_config.checkpoint.exit_duration_in_mins
        if minutes is None:
            return False
        done = torch.tensor([time.monotonic() - self.started > minutes * 60], dtype=torch.int32,
                            device=self._buffers[0].device)
        dist.all_reduce(done, op=dist.ReduceOp.MAX)
        return bool(done.item())
