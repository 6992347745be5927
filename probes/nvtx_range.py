"""Named ranges that show up in Nsight Systems (NVTX) and in torch.profiler traces (record_function) alike.

NVTX ranges never reach Kineto's Chrome traces, and record_function ranges never reach nsys, so a range that both a
Perfetto user and an nsys user should see is emitted twice under one name. `Marker.enter/exit` does both.

NVTX backends, in order: the `nvtx` package (colours, categories, the "train-ledger" domain), torch.cuda.nvtx when
CUDA is present (plain push/pop; the category goes into the message), else none. A record_function is entered only
while the profiler is collecting: outside the profiler window it would record nothing and still cost a dispatch.
"""
from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch

from common.events import RANGE_CATEGORIES

DOMAIN = "train-ledger"

# One colour per category, so the same kind of work looks the same in every run's timeline.
CATEGORY_COLOURS: dict[str, str] = {
    "iteration": "grey",
    "forward": "green",
    "backward": "blue",
    "optimizer": "purple",
    "dp-comm": "orange",
    "pp-comm": "red",
    "tp-comm": "yellow",
    "dp-wait": "white",  # a stall: the compute stream waits for a DP collective (its name starts with "wait ")
    "embd-comm": "cyan",
    "checkpoint": "magenta",  # a checkpoint's save or load (engine.checkpointing), between steps
    "data-wait": "black",  # a stall: the training loop waits for its loader's next micro-batch ("wait data mbN")
    "cp-comm": "lime",  # ring attention's K/V (and dK/dV) exchange with the next and previous CP rank
    "cp-wait": "white",  # a stall: attention waits for a ring exchange still in flight
    "ep-comm": "olive",  # MoE token dispatch / combine all-to-all over the expert-parallel group
    "mp-comm": "brown",  # the grad norm's all-reduce over the model-parallel group
    "wgrad": "darkblue",  # weight gradients computed apart from the backward (--moe-delay-expert-wgrad's flush)
}
assert tuple(CATEGORY_COLOURS) == RANGE_CATEGORIES, "a colour for each of common.events' categories"
CATEGORIES = RANGE_CATEGORIES


def check_category(category: str) -> None:
    if category not in CATEGORY_COLOURS:
        raise ValueError(f"range category {category!r} is not one of {', '.join(CATEGORIES)}")


def profiler_active() -> bool:
    """True while torch.profiler is collecting; one C call."""
    return torch.autograd._profiler_enabled()


class Marker:
    """Opens and closes one named range in NVTX (when on) and in the profiler (when collecting)."""

    def __init__(self, nvtx_on: bool):
        self.backend = "off"
        self._push: Callable[[str, str], object] | None = None
        self._pop: Callable[[], object] | None = None
        self._start: Callable[[str, str], object] | None = None
        self._end: Callable[[object], object] | None = None
        if nvtx_on:
            self._choose_backend()

    def _choose_backend(self) -> None:
        try:
            import nvtx
        except ImportError:
            nvtx = None
        if nvtx is not None:
            self._push = lambda name, cat: nvtx.push_range(message=name, color=CATEGORY_COLOURS[cat],
                                                           domain=DOMAIN, category=cat)
            self._pop = lambda: nvtx.pop_range(domain=DOMAIN)
            self._start = lambda name, cat: nvtx.start_range(message=name, color=CATEGORY_COLOURS[cat],
                                                             domain=DOMAIN, category=cat)
            self._end = nvtx.end_range
            self.backend = "nvtx"
        elif torch.cuda.is_available():
            self._push = lambda name, cat: torch.cuda.nvtx.range_push(f"{cat}: {name}")
            self._pop = torch.cuda.nvtx.range_pop
            self._start = lambda name, cat: torch.cuda.nvtx.range_start(f"{cat}: {name}")
            self._end = torch.cuda.nvtx.range_end
            self.backend = "torch.cuda.nvtx"
        else:
            self.backend = "none (no nvtx package, no CUDA)"

    @property
    def nvtx_active(self) -> bool:
        return self._push is not None

    def enter(self, name: str, category: str) -> object | None:
        """Open the range; returns the record_function to hand back to `exit` (None outside the profiler)."""
        if self._push is not None:
            self._push(name, category)
        if not profiler_active():
            return None
        rf = torch.profiler.record_function(name)
        rf.__enter__()
        return rf

    def exit(self, rf: object | None) -> None:
        if rf is not None:
            rf.__exit__(None, None, None)  # type: ignore[attr-defined]
        if self._pop is not None:
            self._pop()

    def start(self, name: str, category: str) -> object | None:
        """An NVTX range that may overlap others (an async collective): no push/pop nesting, no record_function."""
        return self._start(name, category) if self._start is not None else None

    def end(self, handle: object | None) -> None:
        if handle is not None:
            self._end(handle)  # type: ignore[misc]

    def annotation(self, name: str) -> contextlib.AbstractContextManager:
        """A record_function of `name` inside the profiler window (nothing outside it), without NVTX."""
        return torch.profiler.record_function(name) if profiler_active() else contextlib.nullcontext()

    @contextlib.contextmanager
    def range(self, name: str, category: str) -> Iterator[None]:
        rf = self.enter(name, category)
        try:
            yield
        finally:
            self.exit(rf)
