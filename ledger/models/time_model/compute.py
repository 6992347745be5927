"""Forward and backward time of one micro-batch through one model chunk: the sum of its ops' calibrated times.

A pass (ops.py) is priced entry by entry: kernels from the compute sweep, TP collectives and the expert-parallel
all-to-alls from the link fits (they run on the compute stream, so their time adds to the pass: nothing overlaps
them). The running sum gives, for every
parameter, its offset from the start of the pass: in a forward where it is first used (a param all-gather must be
complete by then), in a backward where its gradient is final (its DP bucket may be issued once all of its
parameters are). The breakdown by term (layers, recompute, embedding, output_layer, cross_entropy, final_norm,
tp_comm, cp_comm, ep_comm) names the largest contributor of a stage's time.

Context parallelism's ring messages (ops.py, `cp` collectives with `overlaps`) run on their own stream beside the
block they overlap: the pass waits only for max(0, transfer - that block's kernel time) before the next block, the
exposed part (`cp_exposed`; ledger/models/formulas/ring_overlap.py exchange_exposed, the formula the overlap row's
hidden share is 1 - exposed / transfer of); `cp_transfer` is their whole standalone time, so the hidden part is the
difference.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable

from common.config import RunConfig
from common.ops.compute_class import kernel_class
from ledger.models.formulas.params import num_chunks
from ledger.models.formulas.ring_overlap import exchange_exposed
from ledger.models.time_model.calibration import Calibration
from ledger.models.time_model.ops import Collective, Work, chunk_backward, chunk_forward


@dataclass(frozen=True)
class PassTime:
    seconds: float
    terms: dict[str, float]  # breakdown label -> seconds
    marks: dict[str, float]  # parameter -> offset from the pass start (forward: first use; backward: grad final)
    comm: float  # of `seconds`, the TP collectives
    ep_comm: float = 0.0  # of `seconds`, the expert-parallel all-to-alls (on the compute stream: all exposed)
    cp_exposed: float = 0.0  # of `seconds`, the CP ring's messages beyond the blocks they overlap
    cp_transfer: float = 0.0  # the CP ring's messages at standalone speed (not all of it in `seconds`)
    by_class: dict[str, float] = field(default_factory=dict)  # of `seconds`, the kernels by compute class


@dataclass(frozen=True)
class ChunkTime:
    forward: PassTime
    backward: PassTime


def entry_seconds(w: Work, cfg: RunConfig, cal: Calibration) -> tuple[float, float]:
    """(seconds the pass spends on the entry, its standalone transfer time if it is a collective beside a kernel)."""
    sizes = {"tp": cfg.parallel.tensor_model_parallel_size, "cp": cfg.parallel.context_parallel_size,
             "ep": cfg.parallel.expert_model_parallel_size}
    if isinstance(w.op, Collective):
        transfer = cal.comm.seconds(w.op.group, w.op.kind, sizes[w.op.group], w.op.size_bytes)
        if w.op.overlaps is not None:  # beside a kernel: its excess only
            return exchange_exposed(transfer, cal.kernel_seconds(w.op.overlaps, cfg.train.params_dtype)), transfer
        return transfer, 0.0
    return cal.kernel_seconds(w.op, cfg.train.params_dtype), 0.0


def price(work: list[Work], cfg: RunConfig, cal: Calibration, forward: bool) -> PassTime:
    clock = comm = ep_comm = cp_exposed = cp_transfer = 0.0
    terms: dict[str, float] = defaultdict(float)
    by_class: dict[str, float] = defaultdict(float)
    marks: dict[str, float] = {}
    for w in work:
        seconds, beside = entry_seconds(w, cfg, cal)
        if not isinstance(w.op, Collective):
            by_class[kernel_class(w.op)] += seconds
        elif w.op.overlaps is not None:
            cp_transfer += beside
            cp_exposed += seconds
        elif w.op.group == "ep":
            ep_comm += seconds
        else:
            comm += seconds
        for name in w.params if forward else ():
            marks.setdefault(name, clock)
        clock += seconds
        terms[w.term] += seconds
        for name in w.params if not forward else ():
            marks[name] = clock
    return PassTime(seconds=clock, terms=dict(terms), marks=marks, comm=comm, ep_comm=ep_comm, cp_exposed=cp_exposed,
                    cp_transfer=cp_transfer, by_class=dict(by_class))


def class_seconds(work: list[Work], cfg: RunConfig, cal: Calibration,
                  kernels: Callable[[Work], int] = lambda w: 1) -> tuple[tuple[str, float, int], ...]:
    """The kernels of `work` (its collectives left out) by compute class: (class, seconds, kernels), `kernels`
    counting each entry's launches."""
    found: dict[str, tuple[float, int]] = {}
    for w in work:
        if not isinstance(w.op, Collective):
            seconds, count = found.get(kernel_class(w.op), (0.0, 0))
            found[kernel_class(w.op)] = (seconds + entry_seconds(w, cfg, cal)[0], count + kernels(w))
    return tuple((cls, seconds, count) for cls, (seconds, count) in found.items())


def chunk_time(cfg: RunConfig, cal: Calibration, pp_rank: int, chunk: int) -> ChunkTime:
    return ChunkTime(forward=price(chunk_forward(cfg, pp_rank, chunk), cfg, cal, forward=True),
                     backward=price(chunk_backward(cfg, pp_rank, chunk), cfg, cal, forward=False))


@dataclass(frozen=True)
class StageTime:
    """A pipeline stage's chunks; per micro-batch figures are means over them (what one forward or backward range
    of the stage takes on average)."""
    chunks: tuple[ChunkTime, ...]

    @property
    def forward(self) -> float:
        return sum(c.forward.seconds for c in self.chunks) / len(self.chunks)

    @property
    def backward(self) -> float:
        return sum(c.backward.seconds for c in self.chunks) / len(self.chunks)

    def terms(self, forward: bool) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for c in self.chunks:
            for term, seconds in (c.forward if forward else c.backward).terms.items():
                out[term] += seconds / len(self.chunks)
        return dict(out)


def stage_time(cfg: RunConfig, cal: Calibration, pp_rank: int) -> StageTime:
    return StageTime(tuple(chunk_time(cfg, cal, pp_rank, c) for c in range(num_chunks(cfg))))
