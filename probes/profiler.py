"""The profiler window: --use-pytorch-profiler / --nsys-profile over steps A..B on --profile-ranks (Megatron's flags).

torch.profiler runs with CPU (+ CUDA when present) activities and writes one Chrome trace per profiled rank,
RUN/traces/rank{R}.step{A}-{B}.json.gz, in the shape HolisticTraceAnalysis 0.5.0 reads:
  * `distributedInfo` with this rank and the world size. HTA finds a trace's rank with a regex that needs
    `"rank": N` with a space after the colon, so the trace is re-serialised with json's default separators.
  * timestamps in whole microseconds: Kineto writes fractions of a microsecond, and HTA 0.5.0 sums float64
    timestamps of magnitude ~1e12, so its temporal breakdown can find a merged union smaller than its own subset
    and fail an assertion. Each event's start and end are rounded (dur = end - start), which keeps every ordering
    between two boundaries: overlaps and gaps stay what they were, to within 0.5 us.
  * one `ProfilerStep#N` range per step, N the engine's own iteration number (entered at step_begin, left at
    step_end). HTA drops the last ProfilerStep of a trace as possibly incomplete, so the window records one extra
    step, B+1, to be dropped: steps A..B survive. If the run ends before B+1, the trace is written at close and HTA
    will drop B. The file name keeps the requested window A-B either way; `trainLedger.steps_recorded` says what the
    trace holds, and `trainLedger.run_id` which run it belongs to (the manifest's run_id).
--nsys-profile calls cudaProfilerStart/Stop (torch.cuda.profiler) around exactly steps A..B on the same ranks, so
`nsys profile --capture-range=cudaProfilerApi` captures just the window.
"""
from __future__ import annotations

import gzip
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch.torch_version import TorchVersion

from common.run_dir import atomic_open, trace_path

# Kineto's log level above its highest (USDT): torch 2.13's Kineto prints a start and a stop line for every window
# on every rank, which buried a run's own output. A user's own KINETO_LOG_LEVEL is kept; a window that records
# nothing still shows, in the trace the ledger reads.
KINETO_QUIET = "6"
TRACE_GZIP_LEVEL = 6  # zlib's default: 15% larger than level 9 and four times faster
# The first CUDA whose CUPTI re-attaches after a teardown with CUDA graphs captured (torch's own rule,
# torch/profiler/profiler.py): before it, torch turns teardown off where graphs are used, and so do we.
CUPTI_TEARDOWN_SAFE_CUDA = "12.6"


def detach_cupti_after_profiling() -> None:
    """Kineto leaves CUPTI attached when a profiler stops unless TEARDOWN_CUPTI=1 (read at the stop), and every
    later CUDA call pays its callbacks. Set before the window's stop only: the host sweep's profiled half leaves CUPTI
    attached for the window, which then starts without re-attaching it, and the steps after the window run without
    it. A user's own TEARDOWN_CUPTI is kept."""
    cuda = torch.version.cuda
    if cuda and TorchVersion(cuda) >= CUPTI_TEARDOWN_SAFE_CUDA:
        os.environ.setdefault("TEARDOWN_CUPTI", "1")


def torch_profile() -> torch.profiler.profile:
    """The profiler as the window runs it (CPU and, where present, CUDA activities; shapes recorded): the host sweep
    times its primitives under the same one."""
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET)
    activities = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    return torch.profiler.profile(activities=activities, record_shapes=True)


class ProfilerWindow:
    def __init__(self, run_dir: str | os.PathLike, rank: int, world_size: int, run_id: str, start: int, end: int,
                 ranks: list[int], use_torch_profiler: bool, nsys: bool):
        on_this_rank = rank in ranks
        self.run_dir, self.rank, self.world_size, self.run_id = run_dir, rank, world_size, run_id
        self.start, self.end = start, end
        self.some_rank_traces = use_torch_profiler and bool(ranks)
        self.use_torch_profiler = use_torch_profiler and on_this_rank
        self.nsys = nsys and on_this_rank and torch.cuda.is_available()
        self.nsys_without_cuda = nsys and on_this_rank and not torch.cuda.is_available()
        self._prof: torch.profiler.profile | None = None
        self._step_rf: Any = None
        self._first = self._last = None
        self._nsys_running = False
        self.written: Path | None = None

    @property
    def note(self) -> str:
        parts = []
        if self.use_torch_profiler:
            parts.append(f"torch.profiler steps {self.start}-{self.end} (+1 for HTA)")
        if self.nsys:
            parts.append(f"cudaProfilerStart/Stop steps {self.start}-{self.end}")
        if self.nsys_without_cuda:
            parts.append("--nsys-profile off: no CUDA")
        return "; ".join(parts) or "off on this rank"

    @property
    def recording(self) -> bool:
        """Whether this rank's profiler (torch.profiler or an nsys capture) is collecting the current step."""
        return self._prof is not None or self._nsys_running

    def follows_export(self, step: int) -> bool:
        """Whether `step` comes right after the step at whose end the profiled ranks wrote their traces (B + 1): its
        first collective makes every rank wait for the slowest export. Never in a world of one: nobody waits."""
        return self.some_rank_traces and self.world_size > 1 and step == self.end + 2

    def step_begin(self, step: int) -> None:
        if self.nsys and step == self.start:
            torch.cuda.profiler.start()
            self._nsys_running = True
        if self.use_torch_profiler and step == self.start and self._prof is None:
            self._prof = torch_profile()
            self._prof.start()
            self._first = step
        if self._prof is not None:
            self._step_rf = torch.profiler.record_function(f"ProfilerStep#{step}")
            self._step_rf.__enter__()
            self._last = step

    def step_end(self, step: int) -> None:
        if self._step_rf is not None:
            self._step_rf.__exit__(None, None, None)
            self._step_rf = None
        if self._nsys_running and step >= self.end:
            self._stop_nsys()
        if self._prof is not None and step >= self.end + 1:
            self._finish()

    def close(self) -> None:
        """Stop whatever is still running (a run shorter than the window, or a failure) and write what was caught."""
        if self._step_rf is not None:
            self._step_rf.__exit__(None, None, None)
            self._step_rf = None
        if self._nsys_running:
            self._stop_nsys()
        if self._prof is not None:
            self._finish()

    def _stop_nsys(self) -> None:
        torch.cuda.synchronize()
        torch.cuda.profiler.stop()
        self._nsys_running = False

    def _finish(self) -> None:
        prof, self._prof = self._prof, None
        detach_cupti_after_profiling()
        prof.stop()
        path = trace_path(self.run_dir, self.rank, self.start, self.end)
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            raw = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(raw))
            write_hta_trace(raw, path, self.rank, self.world_size, run_id=self.run_id,
                            steps=(self._first, self._last), window=(self.start, self.end))
        self.written = path


def write_hta_trace(raw: Path, out: Path, rank: int, world_size: int, *, run_id: str, steps: tuple[int, int],
                    window: tuple[int, int]) -> None:
    """Gzip a Kineto Chrome trace the way HTA 0.5.0 reads it: whole-us times, distributedInfo with `"rank": N`;
    `trainLedger.run_id` ties the file to its run's manifest (the ledger refuses a trace from another run)."""
    trace = json.loads(raw.read_text(encoding="utf-8"))
    for event in trace.get("traceEvents", []):
        _whole_microseconds(event)
    info = trace.setdefault("distributedInfo", {})
    info["rank"] = rank
    info.setdefault("world_size", world_size)
    trace["trainLedger"] = {"run_id": run_id, "window": list(window), "steps_recorded": list(steps),
                            "hta_note": "HTA drops the last ProfilerStep; the window records one extra step"}
    # json.dump into a gzip stream took 2 s a rank for a 16 MB trace (small writes, level 9): 0.4 s this way.
    text = json.dumps(trace)  # default separators: ", " and ": " -- the space HTA's rank regex needs
    with atomic_open(out, raw=True) as f:
        f.write(gzip.compress(text.encode("utf-8"), compresslevel=TRACE_GZIP_LEVEL))


def _whole_microseconds(event: dict[str, Any]) -> None:
    ts = event.get("ts")
    if not isinstance(ts, (int, float)):
        return
    start = round(ts)
    if isinstance(event.get("dur"), (int, float)):
        event["dur"] = round(ts + event["dur"]) - start
    event["ts"] = start
