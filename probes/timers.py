"""Per-range timers that cost no host synchronisation in the hot path.

On CUDA a range records two torch.cuda.Events on the current stream; nothing waits for them until the step ends,
when `collect` synchronises each finished range's end event (the last one recorded is the only real wait: the
others completed before it in stream order) and reads `elapsed_time` against the event recorded at step begin.
So `start_s` / `end_s` are GPU stream positions relative to the step-begin marker, which is what the pipeline
timeline (bubble) and per-bucket comm intervals need. Without CUDA the clock is time.perf_counter (host time).

Absolute times: `t_start` / `t_end` = host wall time at step begin + the relative time. On CUDA that mixes clocks
(the GPU may run behind the host), so absolute times there are aligned to the step start, not to the host.

Host times: `host_start_s` / `host_end_s` are time.perf_counter seconds from the step's anchor when the host opened
and closed the range, always. On CUDA the device reaches those points later, by however far the host runs ahead;
the engine begins a step with the device drained (the last step's reads), so the two clocks share their origin to
within a launch's latency and a range's host and device times can be set side by side (how far ahead the host ran).

Async collectives (`comm_begin` at issue, `comm_end` after the wait returned): `issue_s` and `wait_return_s` are the
host times of those two calls, always. On CUDA `start_s` / `end_s` are events recorded at the same two calls, i.e.
when the issuing stream reached the issue point and when it could proceed past the wait (the collective done, as
seen by that stream). On CPU with gloo the host times are all there is: `end_s` is when the wait returned, which
bounds the collective's completion from above, not its true end.
"""
from __future__ import annotations

import time
from typing import Any

import torch


class _Anchor:
    """The start of one step: the reference every range of that step is timed against."""

    __slots__ = ("step", "wall0", "perf0", "event0")

    def __init__(self, step: int | None, event0: Any):
        self.step, self.wall0, self.perf0, self.event0 = step, time.time(), time.perf_counter(), event0


class _Interval:
    __slots__ = ("name", "category", "attrs", "anchor", "start", "end", "host_start", "host_end", "async_comm")

    def __init__(self, name: str, category: str, attrs: dict[str, Any], anchor: _Anchor):
        self.name, self.category, self.attrs, self.anchor = name, category, attrs, anchor
        self.start = self.end = self.host_start = self.host_end = None
        self.async_comm = False


class StepTimer:
    """Buffers intervals during a step and turns the finished ones into `timing` records at step end."""

    def __init__(self, use_cuda: bool):
        self.use_cuda = use_cuda
        self.clock = "cuda_event" if use_cuda else "perf_counter"
        self._free_events: list[Any] = []
        self._open: list[_Interval] = []
        self._anchor = _Anchor(None, self._mark())

    def _mark(self) -> Any:
        if not self.use_cuda:
            return time.perf_counter()
        event = self._free_events.pop() if self._free_events else torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def step_begin(self, step: int) -> None:
        self._anchor = _Anchor(step, self._mark())

    def step_end(self) -> None:
        """Close the step: ranges started from now until the next step_begin belong to no step (step None), so work
        after the last step (the engine's final forced param all-gather, waiting on a rank that is still writing its
        profiler trace) cannot land in the last step's figures."""
        self._anchor = _Anchor(None, self._mark())

    def _host_and_mark(self) -> tuple[float, Any]:
        """The host's clock and the range's mark, read together: without CUDA the mark is that same reading (two
        reads could straddle a preemption and disagree by a scheduler's slice)."""
        host = time.perf_counter()
        return host, (self._mark() if self.use_cuda else host)

    def start(self, name: str, category: str, attrs: dict[str, Any]) -> _Interval:
        interval = _Interval(name, category, attrs, self._anchor)
        interval.host_start, interval.start = self._host_and_mark()
        self._open.append(interval)
        return interval

    def stop(self, interval: _Interval) -> None:
        if self.use_cuda:
            interval.end = self._mark()
            interval.host_end = time.perf_counter()
        else:
            interval.host_end, interval.end = self._host_and_mark()

    def comm_begin(self, name: str, category: str, attrs: dict[str, Any]) -> _Interval:
        interval = self.start(name, category, attrs)
        interval.async_comm = True
        return interval

    def comm_end(self, interval: _Interval) -> None:
        self.stop(interval)

    def collect(self) -> list[dict[str, Any]]:
        """Timing records of every finished interval; unfinished ones (spanning step end) wait for a later call."""
        done = [i for i in self._open if i.end is not None]
        self._open = [i for i in self._open if i.end is None]
        records = [self._record(i) for i in done]
        if self.use_cuda:  # anchors' events are not pooled: an unfinished interval may still read its anchor
            self._free_events += [e for i in done for e in (i.start, i.end)]
        return records

    def _relative(self, anchor: _Anchor, mark: Any) -> float:
        if self.use_cuda:
            mark.synchronize()
            return anchor.event0.elapsed_time(mark) / 1e3
        return mark - anchor.perf0

    def _record(self, i: _Interval) -> dict[str, Any]:
        a = i.anchor
        start_s, end_s = self._relative(a, i.start), self._relative(a, i.end)
        record = {"step": a.step, "name": i.name, "category": i.category, "start_s": start_s, "end_s": end_s,
                  "duration_s": end_s - start_s, "t_start": a.wall0 + start_s, "t_end": a.wall0 + end_s,
                  "host_start_s": i.host_start - a.perf0, "host_end_s": i.host_end - a.perf0, "clock": self.clock,
                  **i.attrs}
        if i.async_comm:  # its host times are the issue's and the wait's return
            record.update(async_comm=True, issue_s=record["host_start_s"], wait_return_s=record["host_end_s"])
        return record
