"""The layout search: every valid layout of a run on N GPUs (layouts.py), those that do not fit dropped, the rest
ranked by predicted tokens/s, each of the top K after the first with the reason it loses to the first.

    result = search(base, 1024, fits=memory_fit(hw.hbm_bytes), score=lambda c: predict_step(c, cal_of(c)),
                    top=5, gpus_per_node=hw.gpus_per_node, bound=calibrated_bound(cal_of))

(cal_of: the layout's Calibration, e.g. ledger.models.simulate.hardware_calibration(c, hw), best memoised per layout:
the bound and the score both ask for it.) Measured by runs/bench/search_layouts.py (llama3.1-70b, seq 4096, global
batch 1024, bf16, overlapped distributed optimizer, 1,024 H200s, 8 a node, on this project's shared 2-core machine):
2,814 valid layouts enumerated in 0.1 s, the memory of all of them in 1.5 s (1,754 fit), the calibrated bound then
lets 80 be scored and skips 1,674: 10 s for the whole search, the same top 5 as scoring all 1,754 (132 s). With
the time model of 2026-12-01 the bound lets 185 be scored (1,580 skipped): 8.9-10.8 s of CPU time, which is what
the CLI prints beside the wall time (on a shared machine the wall time is several times that).
tokens_per_s_bound (FLOPs at 0.845 x the peak, the hardware file's best GEMM efficiency) skips only about 400.

Order of work, cheapest first: enumerate and validate (microseconds a layout); `fits` (the memory formulas, about a
millisecond: buffers are cached per layout-deciding fields); then, where a `bound` is given, layouts in decreasing
order of their bound, each scored unless its bound cannot beat the K-th best score found so far, at which point every
later one is skipped too (their bounds are no higher). A bound must never be below a layout's score, or a layout
of the true top K could be skipped: bound.py's tokens_per_s_bound holds for any score that runs no kernel faster than
the peak, calibrated_bound for ledger.models.time_model.predict_step on the same calibration. `score` returns what the
time model predicts (anything with `.tokens_per_s` and `.terms`: seconds per step by named term,
ledger.models.time_model.StepPrediction); the reason a layout loses names the term that grows most against the
first's (LosingReason), e.g. "pipeline bubble +210 ms".

Torch-free, and independent of the hardware: the caller's `fits` and `score` carry it.
"""
from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from common.config import RunConfig
from common.errors import ConfigError
from ledger.models.formulas.peak_memory import peak_bytes_per_stage
from ledger.models.simulate.layouts import describe, enumerate_layouts, label

GiB = 2**30  # as every size the CLI prints (ledger/present/units.size)


class Prediction(Protocol):
    tokens_per_s: float
    terms: dict[str, float]


@dataclass(frozen=True)
class LosingReason:
    """Why a layout loses to the first: the term that grows most against the first's (None: none grows), by how many
    seconds, the knobs that differ (name, this layout's value, the first's) and both throughputs.
    ledger/present/search_reason.py writes it as one line."""
    term: str | None
    growth_s: float
    changes: tuple[tuple[str, str, str], ...]
    tokens_per_s: float
    first_tokens_per_s: float


@dataclass(frozen=True)
class Ranked:
    layout: RunConfig
    prediction: Prediction
    reason: LosingReason | None  # why it loses to the first; None for the first

    @property
    def label(self) -> str:
        return label(self.layout)


@dataclass
class SearchResult:
    ranked: list[Ranked]  # best first, at most `top`
    enumerated: int  # valid layouts
    fitting: int
    scored: int
    skipped_by_bound: int  # fitting layouts whose bound could not reach the top K: never scored
    dropped: dict[str, int] = field(default_factory=dict)  # why not fitting (kind: the text before ":") -> count
    dropped_example: dict[str, str] = field(default_factory=dict)  # kind -> the first full reason
    seconds: dict[str, float] = field(default_factory=dict)  # "enumerate_and_fit", "score": wall-clock seconds
    cpu_seconds: float = 0.0  # this process's CPU time for the whole search: the wall time less any wait for a core


def memory_fit(capacity_bytes: float, outside_bytes: Callable[[RunConfig], float] | float = 0.0
               ) -> Callable[[RunConfig], bool | str]:
    """A `fits` for search(): every stage's peak (peak_memory.py) plus what lies outside PyTorch (a number, or a
    function of the layout) within the device's capacity; else "out of memory: stage S needs X GiB of Y GiB"."""
    def fits(cfg: RunConfig) -> bool | str:
        outside = outside_bytes(cfg) if callable(outside_bytes) else outside_bytes
        peaks = peak_bytes_per_stage(cfg)
        stage = max(range(len(peaks)), key=peaks.__getitem__)
        if peaks[stage] + outside <= capacity_bytes:
            return True
        return (f"out of memory: stage {stage} needs {(peaks[stage] + outside) / GiB:,.1f} GiB of "
                f"{capacity_bytes / GiB:,.1f} GiB")
    return fits


def search(base: RunConfig, gpus: int, fits: Callable[[RunConfig], bool | str],
           score: Callable[[RunConfig], Prediction], top: int = 5, *, gpus_per_node: int,
           bound: Callable[[RunConfig], float] | None = None, **enumerate_options) -> SearchResult:
    """Rank the layouts of `base` on `gpus` GPUs (module docstring). `fits` returns True, or False / a reason
    ("kind: detail") for a layout that does not fit; `bound` an upper bound of a layout's tokens/s, or None to score
    every fitting layout. enumerate_options go to enumerate_layouts (recompute, distributed_optimizer,
    sequence_parallel)."""
    if top < 1:
        raise ConfigError(f"--top must be >= 1, got {top}")
    t0, cpu0 = time.perf_counter(), time.process_time()
    enumerated, fitting = 0, []
    dropped: Counter[str] = Counter()
    example: dict[str, str] = {}
    for cfg in enumerate_layouts(base, gpus, gpus_per_node=gpus_per_node, **enumerate_options):
        enumerated += 1
        verdict = fits(cfg)
        if verdict is True:
            fitting.append(cfg)
            continue
        reason = verdict if isinstance(verdict, str) else "does not fit"
        kind = reason.split(":", 1)[0]
        dropped[kind] += 1
        example.setdefault(kind, reason)
    t1 = time.perf_counter()
    best, scored, skipped = _score_top(fitting, score, top, bound)
    ranked = [Ranked(cfg, pred, None if i == 0 else loses_because(cfg, pred, best[0][2], best[0][3]))
              for i, (_, _, cfg, pred) in enumerate(best)]
    return SearchResult(ranked=ranked, enumerated=enumerated, fitting=len(fitting), scored=scored,
                        skipped_by_bound=skipped, dropped=dict(dropped), dropped_example=example,
                        seconds={"enumerate_and_fit": t1 - t0, "score": time.perf_counter() - t1},
                        cpu_seconds=time.process_time() - cpu0)


def _score_top(fitting: list[RunConfig], score: Callable[[RunConfig], Prediction], top: int,
               bound: Callable[[RunConfig], float] | None) -> tuple[list[tuple[float, int, RunConfig, Prediction]],
                                                                  int, int]:
    """The `top` best (tokens/s, enumeration index, layout, prediction), best first (ties: enumeration order); how
    many were scored, and how many the bound skipped."""
    order = list(range(len(fitting)))
    bounds = [bound(c) for c in fitting] if bound is not None else None
    if bounds is not None:
        order.sort(key=lambda i: -bounds[i])
    heap: list[tuple[float, int, RunConfig, Prediction]] = []  # the current top, worst on top: (tps, -index, ...)
    scored = 0
    for position, i in enumerate(order):
        if bounds is not None and len(heap) == top and bounds[i] < heap[0][0]:
            return _best_first(heap), scored, len(order) - position
        prediction = score(fitting[i])
        scored += 1
        item = (prediction.tokens_per_s, -i, fitting[i], prediction)
        if len(heap) < top:
            heapq.heappush(heap, item)
        elif item[:2] > heap[0][:2]:
            heapq.heapreplace(heap, item)
    return _best_first(heap), scored, 0


def _best_first(heap: list[tuple[float, int, RunConfig, Prediction]]) -> list[tuple[float, int, RunConfig,
                                                                                     Prediction]]:
    """(-tokens/s, index, layout, prediction), best first: sorting ascending puts the most tokens/s first and, among
    equals, the earliest enumerated."""
    return sorted((-tps, -neg_index, cfg, pred) for tps, neg_index, cfg, pred in heap)


def loses_because(cfg: RunConfig, prediction: Prediction, first: RunConfig,
                  first_prediction: Prediction) -> LosingReason:
    """The term that grows most against the first's, what the layouts change, and both throughputs."""
    terms, base = prediction.terms, first_prediction.terms
    growth = {name: terms.get(name, 0.0) - base.get(name, 0.0) for name in {**base, **terms}}
    name = max(sorted(growth), key=growth.__getitem__)
    mine, theirs = describe(cfg), describe(first)
    changes = tuple((k, _show(v), _show(theirs[k])) for k, v in mine.items() if v != theirs[k])
    grows = growth[name] > 0
    return LosingReason(term=name if grows else None, growth_s=growth[name] if grows else 0.0, changes=changes,
                        tokens_per_s=prediction.tokens_per_s, first_tokens_per_s=first_prediction.tokens_per_s)


def _show(value: object) -> str:
    return {True: "on", False: "off"}.get(value, str(value)) if isinstance(value, bool) else str(value)
