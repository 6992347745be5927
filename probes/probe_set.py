"""The one object the engine calls at its lifecycle points: `ProbeSet` writes the run directory, `NullProbeSet`
(probes off) does nothing at the cost of one call.

The calls the engine makes are probes.protocol.ProbeSetProtocol, which both classes here provide; the hot-path rule
and what each event kind holds: docs/architecture.md ("The engine and the probes") and docs/run_directory.md.
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist

from common.errors import ConfigError
from common.events import event
from common.run_dir import MANIFEST, EventWriter, write_manifest
from probes import compute_sweep as compute_sweep_mod
from probes import host_sweep as host_sweep_mod
from probes import manifest as manifest_mod
from probes.bandwidth import Sweep, SweepSizes
from probes.memory import MemoryHistory, MemoryProbe, attach_oom_observer
from probes.nvml import NvmlSampler
from probes.nvtx_range import Marker, check_category, profiler_active
from probes.profiler import ProfilerWindow
from probes.tensorboard import TensorBoardLog
from probes.timers import StepTimer

_NULL = contextlib.nullcontext()
# An inventory dict's own "kind" (param, grad buffer, ...) would clash with the event envelope's keys.
_ENVELOPE_RENAMES = {"kind": "tensor_kind", "step": "item_step", "t": "item_t"}


class NullProbeSet:
    enabled = False

    def memory_point(self, name: str, held: Callable[[], Iterable[Any]] | None = None) -> None:
        pass

    def inventory(self, records: list[dict[str, Any]]) -> None:
        pass

    def range(self, name: str, category: str, **attrs: Any) -> contextlib.AbstractContextManager[None]:
        return _NULL

    def collective_sweep(self, parallel_state: Any, **sizes: Any) -> None:
        pass

    def compute_sweep(self, run_config: Any, **shapes: Any) -> None:
        pass

    def comm_issue(self, name: str, category: str, issue: Callable[[], Any], **attrs: Any) -> tuple[Any, None]:
        return issue(), None

    def host_sweep(self, passes: Callable[[], dict[str, float]] | None = None) -> None:
        pass

    def comm_end(self, token: Any) -> None:
        pass

    def checkpoint(self, action: str, **fields: Any) -> None:
        pass

    def step_begin(self, iteration: int) -> None:
        pass

    def step_end(self, iteration: int, **figures: Any) -> None:
        pass

    def close(self, status: str = "complete", error: str | None = None) -> None:
        pass


class _ProbedRange:
    __slots__ = ("probes", "name", "category", "attrs", "_rf", "_interval")

    def __init__(self, probes: "ProbeSet", name: str, category: str, attrs: dict[str, Any]):
        self.probes, self.name, self.category, self.attrs = probes, name, category, attrs

    def __enter__(self) -> None:
        self._rf = self.probes.marker.enter(self.name, self.category)
        timer = self.probes.timer
        self._interval = timer.start(self.name, self.category, self.attrs) if timer is not None else None

    def __exit__(self, *exc: Any) -> None:
        if self._interval is not None:
            self.probes.timer.stop(self._interval)  # type: ignore[union-attr]
        self.probes.marker.exit(self._rf)


class ProbeSet:
    enabled = True

    def __init__(self, run_config: Any, parallel_state: Any, argv: list[str]):
        pc = run_config.probes
        self.run_dir = Path(pc.run_dir)
        self.rank, self.world_size = parallel_state.rank, parallel_state.world_size
        if (self.run_dir / MANIFEST).exists():  # every rank checks before the collective below, so all agree
            raise ConfigError(f"--run-dir {self.run_dir}: already holds a run ({MANIFEST}); choose a new directory")
        use_cuda = torch.cuda.is_available()
        self._step: int | None = None
        self._closed = False
        self.writer = EventWriter(self.run_dir, self.rank)
        self.memory = MemoryProbe(use_cuda)
        self.marker = Marker(pc.nvtx)
        self.timer = StepTimer(use_cuda) if pc.timers else None
        self.bandwidth_sweep = pc.bandwidth_sweep
        self.compute_sweep_on, self.compute_sweep_cache = pc.compute_sweep, pc.compute_sweep_cache
        self.host_sweep_on = pc.host_sweep
        self.nvml = NvmlSampler(pc.nvml_interval)
        self.run_id = manifest_mod.shared_run_id()
        self.window = None
        if pc.use_pytorch_profiler or pc.nsys_profile:
            self.window = ProfilerWindow(self.run_dir, self.rank, self.world_size, self.run_id,
                                         pc.profile_step_start, pc.profile_step_end, pc.profile_ranks,
                                         pc.use_pytorch_profiler, pc.nsys_profile)
        self.history = None
        if pc.record_memory_history:
            self.history = MemoryHistory(use_cuda, self.run_dir / "memory" / f"rank{self.rank}.snapshot.pickle")
        self.tb = None
        if (pc.tensorboard_dir or pc.log_memory_to_tensorboard) and self.rank == self.world_size - 1:
            self.tb = TensorBoardLog(Path(pc.tensorboard_dir or self.run_dir / "tb"), pc.log_memory_to_tensorboard)
        self.oom_handler = attach_oom_observer(self._on_oom)
        self._write_manifest(run_config, parallel_state, argv)

    def _notes(self) -> dict[str, str]:
        """What each probe does on this rank, in words, for the manifest (a disabled probe says why)."""
        return {"nvtx": self.marker.backend, "timers": self.timer.clock if self.timer else "off",
                "memory": f"memory_stats on {self.memory.device}" if self.memory.use_cuda
                else "cpu: process RSS, and at the lifecycle points a census of tensor storages, the engine's and "
                     "all live ones (no CUDA allocator)",
                "nvml": self.nvml.status, "profiler": self.window.note if self.window else "off",
                "memory_history": self.history.note if self.history else "off",
                "tensorboard": str(self.tb.logdir) if self.tb else "off",
                "oom_handler": "attached" if self.oom_handler else "off: no CUDA"}

    def _write_manifest(self, run_config: Any, parallel_state: Any, argv: list[str]) -> None:
        ranks = manifest_mod.gather_rank_infos(manifest_mod.rank_info(parallel_state, self._notes()))
        if self.rank == 0:
            write_manifest(self.run_dir, manifest_mod.build_manifest(run_config, argv, ranks, self.run_id))

    # --- lifecycle points -------------------------------------------------------------------------------------
    def memory_point(self, name: str, held: Callable[[], Iterable[torch.Tensor]] | None = None) -> None:
        self.writer.write(event("memory", self._step, point=name, **self.memory.read_point(held)))
        self.writer.sync()

    def inventory(self, records: list[dict[str, Any]]) -> None:
        for record in records:
            self.writer.write(event("inventory", None, **{_ENVELOPE_RENAMES.get(k, k): v for k, v in record.items()}))
        self.writer.sync()

    def collective_sweep(self, parallel_state: Any, **sizes: Any) -> None:
        """Collective: every rank calls it, with the sizes of probes.bandwidth.SweepSizes (each group's members the
        same). A no-op unless --bandwidth-sweep."""
        if not self.bandwidth_sweep:
            return
        device = torch.device("cuda", torch.cuda.current_device()) if self.memory.use_cuda else torch.device("cpu")
        warmup, iters = (5, 20) if self.memory.use_cuda else (1, 3)
        sweep, at = Sweep(parallel_state, device, warmup=warmup, iters=iters), SweepSizes(**sizes)
        for record in sweep.run(at) + sweep.run(at.latency()):
            self.writer.write(event("bandwidth", None, **record))
        self.writer.sync()

    def compute_sweep(self, run_config: Any, *, first_stage: bool, last_stage: bool, optimizer_numel: int,
                      grad_buffer_numel: int, kernels: compute_sweep_mod.EngineKernels) -> None:
        """A no-op unless --compute-sweep. Each GPU rank times its own device; CPU ranks take turns (_in_turns)."""
        if not self.compute_sweep_on:
            return
        spec = compute_sweep_mod.SweepSpec.from_run(run_config, first_stage=first_stage, last_stage=last_stage,
                                                    optimizer_numel=optimizer_numel,
                                                    grad_buffer_numel=grad_buffer_numel)
        self._in_turns("compute", lambda device: compute_sweep_mod.run(spec, device, kernels,
                                                                       use_cache=self.compute_sweep_cache))

    def host_sweep(self, passes: Callable[[], dict[str, float]] | None = None) -> None:
        """A no-op unless --host-sweep: the host's cost of each primitive call (probes.host_sweep), and on a GPU rank
        of issuing the model's passes (`passes`), under the profiler too when this rank has a profiler window. CPU
        ranks take turns (_in_turns)."""
        if not self.host_sweep_on:
            return
        profiled = self.window is not None and self.window.use_torch_profiler
        self._in_turns("host", lambda device: host_sweep_mod.run(device, profiled, passes))

    def _in_turns(self, kind: str, measure: Callable[[torch.device], list[dict[str, Any]]]) -> None:
        """Write `measure`'s records on this rank's device. CPU ranks take turns (a barrier each), so that no
        measurement shares the cores with another rank's: the time model scales for that sharing."""
        device = torch.device("cuda", torch.cuda.current_device()) if self.memory.use_cuda else torch.device("cpu")
        turns = range(self.world_size) if device.type == "cpu" and dist.is_initialized() else [self.rank]
        for turn in turns:
            if turn == self.rank:
                for record in measure(device):
                    self.writer.write(event(kind, None, **record))
                self.writer.sync()
            if len(turns) > 1:
                dist.barrier()

    # --- hot path -----------------------------------------------------------------------------------------------
    def range(self, name: str, category: str, **attrs: Any) -> contextlib.AbstractContextManager[None]:
        check_category(category)
        if self.timer is None and not self.marker.nvtx_active and not profiler_active():
            return _NULL
        return _ProbedRange(self, name, category, attrs)

    def comm_issue(self, name: str, category: str, issue: Callable[[], Any], **attrs: Any) -> tuple[Any, Any]:
        """Issue an async collective (`issue()`, which returns its work handle): NVTX gets a start/end range (it may
        overlap others) and the timer an interval, both ended by comm_end after the wait; the issue call itself runs
        inside a record_function of the same name, so that a trace ties the collective to this range, and through
        it to its group, whichever worker thread of the group then runs it (ledger.evidence.trace_groups).
        Returns (work, token)."""
        check_category(category)
        handle = self.marker.start(name, category)
        interval = self.timer.comm_begin(name, category, attrs) if self.timer is not None else None
        with self.marker.annotation(name):
            work = issue()
        return work, (handle, interval)

    def comm_end(self, token: Any) -> None:
        handle, interval = token
        if interval is not None:
            self.timer.comm_end(interval)  # type: ignore[union-attr]
        self.marker.end(handle)

    def checkpoint(self, action: str, **fields: Any) -> None:
        """A checkpoint saved or loaded (engine.checkpointing): rare and already a slow file write, so fsynced now."""
        self.writer.write(event("checkpoint", None, action=action, **fields))
        self.writer.sync()

    def step_begin(self, iteration: int) -> None:
        self._step = iteration
        if self.window is not None:
            self.window.step_begin(iteration)
        if self.timer is not None:
            self.timer.step_begin(iteration)

    def step_end(self, iteration: int, **figures: Any) -> None:
        """Write the step's buffered records, then the step record last, then flush once."""
        self._write_timings()
        memory = self.memory.read_step()
        self.writer.write(event("memory", iteration, point="step", **memory))
        self._write_nvml()
        tokens, step_time = figures.get("tokens"), figures.get("step_time_s")
        if tokens is not None and step_time:
            figures.setdefault("tokens_per_s", tokens / step_time)
        figures["profiled"] = self.window is not None and self.window.recording
        figures["after_trace_export"] = self.window is not None and self.window.follows_export(iteration)
        self.writer.write(event("step", iteration, **figures))
        self.writer.sync(wait=False)  # flushed now (SIGKILL-safe); fsynced by the writer's thread
        if self.tb is not None:
            self.tb.log_step(iteration, figures, memory)
        if self.window is not None:
            self.window.step_end(iteration)
        if self.timer is not None:
            self.timer.step_end()

    def _write_timings(self) -> None:
        if self.timer is not None:
            for record in self.timer.collect():
                self.writer.write(event("timing", record.pop("step"), **record))

    def _write_nvml(self) -> None:
        for sample in self.nvml.drain():
            self.writer.write(event("nvml", self._step, **sample))

    def _on_oom(self, details: dict[str, Any]) -> None:
        """Called by the CUDA allocator before it raises OutOfMemoryError: leave this rank's evidence on disk."""
        self.writer.write(event("memory", self._step, point="oom", **self.memory.read(), **details))
        self.writer.sync()
        if self.history is not None:
            self.history.dump()

    def close(self, status: str = "complete", error: str | None = None) -> None:
        """Stop every probe, write what is buffered and this rank's end; safe to call twice (the second is a no-op)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.window is not None:
                self.window.close()
            self.nvml.stop()
            self._write_timings()
            self._write_nvml()
            if status == "failed":
                self.writer.write(event("memory", self._step, point="failure", **self.memory.read()))
            if self.history is not None:
                self.history.stop()
            if self.tb is not None:
                self.tb.close()
            self.writer.write(event("run_end", self._step, status=status, error=error))
        finally:
            self.writer.close()
            manifest_mod.finish(self.run_dir, self.rank, status, error)


def create_probe_set(run_config: Any, parallel_state: Any, argv: list[str]) -> NullProbeSet | ProbeSet:
    """The engine's single entry point: a live ProbeSet when a run directory is set, else NullProbeSet."""
    if not run_config.probes.run_dir:
        return NullProbeSet()
    return ProbeSet(run_config, parallel_state, argv)
