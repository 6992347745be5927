"""Two clocks, one program: the host issues work in program order, the device runs it in that order no earlier than
the host has issued it, and a read of a device value holds the host until the device has drained.

    tl = run(segments, latency)     # Timeline: the host's end, each mark's device time, device busy by kind, reads

A Segment is the host's seconds to issue it, then the device's seconds for it (0: host work only); a `read` makes
the host wait for every earlier device work and then pay the read's own seconds (the device idle meanwhile); a
`mark` is a device event recorded there (a probe range's CUDA event: zero device time, in stream order), which is
how a range's device-side span is read back; an `event` is a device event recorded as the segment's device work
starts, which a later segment's `wait` for that name holds the host for (the oldest one not yet waited for: a
forward's copy of its MoE counts, waited for by the same micro-batch's backward). docs/formulas.md, "Host
timeline".

The device's seconds are the compute sweep's, each kernel timed with its start-up inside, so the time between
kernels that were already enqueued is in them; `run` books it apart (`gaps`, `kernels` x the gap per kernel, the
first kernel of a late segment excepted) beside a late segment's launch latency (`latency`): the step
decomposition's launch-latency term, which a profiled trace measures on its own.

The host gets at most `queue` kernels ahead of the device: a launch into a full queue waits until the device starts
the kernel that frees its slot (LAUNCH_QUEUE: the dense seq-4096 H200 run's host lead stopped at 85-91 ms of device
work, about a thousand of its kernels; tests/test_host_ranges.py). It moves the host's clock, not the device's.
"""
from __future__ import annotations

from bisect import bisect_left
from collections import deque
from dataclasses import dataclass, field

LAUNCH_QUEUE = 1024  # kernels enqueued and not yet started, at most


@dataclass(frozen=True)
class Segment:
    host: float
    device: float = 0.0
    kind: str = "compute"  # what the device time is: compute, or a collective's group
    read: float | None = None  # a read of the device after this segment's issue: its seconds once drained
    mark: str | None = None
    kernels: int = 0  # the kernels its device seconds run (host_recipe.launched)
    event: str | None = None  # a device event recorded as its device work starts, for a later `wait`
    wait: str | None = None  # before its issue, the host waits for the oldest pending `event` of this name
    wait_all: bool = False  # before its issue, the host waits for every pending event (of any name)
    # its device seconds by compute class (common/ops/compute_class.py), each with its share of the kernels (a
    # weight: the segment's gaps are booked to the classes in proportion); empty for a collective
    classes: tuple[tuple[str, float, int], ...] = ()


@dataclass
class Timeline:
    end: float  # the host's clock when the program ends
    device_end: float
    marks: dict[str, float] = field(default_factory=dict)  # device time of each mark's event
    host_marks: dict[str, float] = field(default_factory=dict)  # host time as each mark's event was recorded
    busy: dict[str, float] = field(default_factory=dict)  # device seconds by kind
    reading: float = 0.0  # host blocked in reads after the device drained (the device idle)
    waiting: float = 0.0  # host blocked in reads while the device still ran
    latency: float = 0.0  # the device idle from a late issue's end to its start
    gaps: float = 0.0  # inside busy: the device between kernels it already held
    compute_by_class: dict[str, float] = field(default_factory=dict)  # busy on compute less its gaps, by class

    @property
    def device_busy(self) -> float:
        return sum(self.busy.values())

    @property
    def host_bound_idle(self) -> float:
        """The device idle while the host works (issues, Python): the rest of the program's span."""
        return self.end - self.device_busy - self.reading - self.latency


def run(segments: list[Segment], latency: float, gap: float = 0.0, queue: int = LAUNCH_QUEUE) -> Timeline:
    """The program on both clocks from 0 (device idle, queue empty); `latency`: from an issue's end to the device
    being able to start it; `gap`: between two enqueued kernels, inside their device seconds; `queue`: the kernels
    the host may have enqueued ahead of the device."""
    host = device = 0.0
    tl = Timeline(end=0.0, device_end=0.0)
    issued: list[int] = [0]  # kernels issued up to each kernel-launching segment, and when the device starts it
    starts: list[float] = [0.0]
    events: dict[str, deque[float]] = {}  # device times of the events not yet waited for, oldest first
    for s in segments:
        reached = _waited_for(s, events)
        if reached is not None:
            tl.waiting += max(0.0, reached - host)
            host = max(host, reached)
        host += s.host
        if s.kernels:  # wait for the device to start the kernel whose start frees the last slot this issue needs
            freeing = min(issued[-1], issued[-1] + s.kernels - queue)
            host = max(host, starts[bisect_left(issued, freeing)]) if freeing > 0 else host
        if s.device > 0:
            late = max(0.0, host + latency - max(device, host))
            tl.latency += late
            gaps = gap * max(0, s.kernels - (late > 0))
            tl.gaps += gaps
            tl.busy[s.kind] = tl.busy.get(s.kind, 0.0) + s.device
            _book_classes(tl.compute_by_class, s.classes, gaps)
        if s.kernels:
            issued.append(issued[-1] + s.kernels)
            starts.append(max(device, host + latency))
        if s.event is not None:
            events.setdefault(s.event, deque()).append(max(device, host + latency))
        if s.device > 0 or s.mark is not None:
            device = max(device, host + latency) + s.device
            if s.mark is not None:
                tl.marks[s.mark], tl.host_marks[s.mark] = device, host
        if s.read is not None:
            tl.waiting += max(0.0, device - host)
            host = max(host, device) + s.read
            tl.reading += s.read
    tl.end, tl.device_end = host, device
    return tl


def _waited_for(s: Segment, events: dict[str, deque[float]]) -> float | None:
    """The device time the host waits for before issuing `s` (None: no wait), the events it waits for taken: the
    oldest pending event of its `wait` name, and with `wait_all` every pending one."""
    reached = []
    if s.wait is not None and events.get(s.wait):
        reached.append(events[s.wait].popleft())
    if s.wait_all and any(events.values()):
        reached.append(max(max(pending) for pending in events.values() if pending))
        events.clear()
    return max(reached, default=None)


def _book_classes(by_class: dict[str, float], classes: tuple[tuple[str, float, int], ...], gaps: float) -> None:
    """A segment's device seconds into its classes, less its gaps shared by the classes' kernels. No class is booked
    below zero: one whose seconds fall short of its kernels' share (a kernel priced under a launch gap) gives all it
    has, and the rest of the gaps is shared by the other classes' kernels."""
    booked = {cls: seconds for cls, seconds, _ in classes}
    weight = {cls: k for cls, _, k in classes}
    sharing = set(booked)
    while gaps > 0 and (kernels := sum(weight[c] for c in sharing)):
        short = [c for c in sharing if booked[c] <= gaps * weight[c] / kernels]
        if not short:
            for c in sharing:
                booked[c] -= gaps * weight[c] / kernels
            break
        for c in short:
            gaps -= booked[c]
            booked[c] = 0.0
            sharing.remove(c)
    for cls, seconds in booked.items():
        by_class[cls] = by_class.get(cls, 0.0) + seconds
