"""Which steps of a run measure steady-state time: every step but the run's first (one-time work: allocator and
cuBLAS warm-up, Adam state creation) and but the steps the profiler disturbed.

The probes flag each step record: "profiled" when this rank's profiler recorded the step (torch.profiler's own cost
is tens of percent of a real step: TP2+SP on two H200s ran ~88k tokens/s before the window and 40-57k inside it),
"after_trace_export" for the step right after the window's traces were written (ranks export at different speeds,
and the next step's first collective makes the faster ones wait for the slowest). A step that one rank flags is
disturbed on every rank, since collectives make the others wait for it. A run recorded before the flags existed gets
the same sets from its config's profiler window, and `source` says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import TYPE_CHECKING, Iterable

from common.config import RunConfig
from common.events import StepRecord

if TYPE_CHECKING:
    from ledger.evidence.run import RunEvidence

FROM_RECORDS = "the step records' profiled flags"
# A figure from timers when every step after the first was profiled (a short run, the demo's): the one caveat, a
# clause of its own so that a report states it once as a numbered note.
PROFILED_COUNTED = ("no step ran outside the profiler window, so the profiled ones are counted, the profiler's cost "
                    "with them")
FROM_CONFIG = "the config's profiler window, as these step records carry no profiled flag"


@dataclass(frozen=True)
class StepSelection:
    first: int | None  # the run's first step
    profiled: frozenset[int]
    after_export: frozenset[int]
    source: str

    @property
    def disturbed(self) -> frozenset[int]:
        return self.profiled | self.after_export

    def steady(self, steps: Iterable[int]) -> list[int]:
        """The steps of `steps` that measure steady-state time: not the run's first, not disturbed by the profiler."""
        return sorted(s for s in set(steps) if s != self.first and s not in self.disturbed)

    def timed(self, steps: Iterable[int]) -> tuple[list[int], str]:
        """(steps, note) for figures taken from timers: the steady steps when there are any, else every step but the
        run's first, with a note that the profiler's cost is then inside the figure."""
        steps = set(steps)
        steady = self.steady(steps)
        if steady or not steps:
            return steady, ""
        kept = sorted(s for s in steps if s != self.first) or sorted(steps)
        return kept, PROFILED_COUNTED

    def describe(self, kept: Iterable[int] = ()) -> str:
        """The disturbed steps a figure over `kept` leaves out, in words, for a row's explanation; "" when it leaves
        none out (a figure that had to count profiled steps says so with PROFILED_COUNTED, not here)."""
        kept = set(kept)
        parts = []
        if self.profiled - kept:
            parts.append(f"{step_list(self.profiled - kept, 'profiled step')}")
        if self.after_export - kept:
            parts.append(f"{step_list(self.after_export - kept)} after the trace export")
        return (" and ".join(parts) + f" left out, per {self.source}") if parts else ""

    def counted(self, kept: Iterable[int]) -> str:
        """The steps a figure counts, and the disturbed ones it leaves out: "steps 2, 6-10 (profiled steps 3-5 left
        out, per ...)"."""
        kept = list(kept)  # read twice: a generator would give the list below nothing
        left = self.describe(kept)
        return step_list(kept) + (f" ({left})" if left else "")


def select_steps(cfg: RunConfig | None, world_size: int, step_records: Iterable[StepRecord],
                 timed_steps: Iterable[int | None] = ()) -> StepSelection:
    """The run's step selection from every rank's step records (and the steps its timing records name)."""
    records = list(step_records)
    steps = {r.step for r in records} | set(timed_steps)
    steps.discard(None)
    first = min(steps) if steps else None  # type: ignore[type-var]
    if any(r.profiled is not None for r in records):
        profiled = frozenset(r.step for r in records if r.profiled and r.step is not None)
        after = frozenset(r.step for r in records if r.after_trace_export and r.step is not None)
        return StepSelection(first, profiled, after, FROM_RECORDS)
    profiled, after = config_window(cfg, world_size)
    return StepSelection(first, profiled, after, FROM_CONFIG)


def run_steps(ev: RunEvidence) -> StepSelection:
    """Which steps measure steady-state time, from every rank's step and timing records."""
    return select_steps(ev.config, ev.world_size, (s for r in ev.ranks.values() for s in r.steps),
                        (t.step for r in ev.ranks.values() for t in r.timing))


def profiler_cost(records: Iterable[StepRecord], selection: StepSelection) -> tuple[float, float] | None:
    """(median profiled step time, median steady step time) in seconds over the timed step records, None without
    both kinds of step."""
    timed = [r for r in records if r.step_time_s]
    steady = set(selection.steady(r.step for r in timed))
    profiled = [r.step_time_s for r in timed if r.step in selection.profiled]
    normal = [r.step_time_s for r in timed if r.step in steady]
    return (median(profiled), median(normal)) if profiled and normal else None


def config_window(cfg: RunConfig | None, world_size: int) -> tuple[frozenset[int], frozenset[int]]:
    """(profiled, after export) as the probes would have flagged them: torch.profiler records steps A..B and one extra
    step for HTA, then writes its trace; nsys captures A..B. A world of one has no other rank to wait for the export."""
    pc = cfg.probes if cfg is not None else None
    if pc is None or not pc.profile_ranks or not (pc.use_pytorch_profiler or pc.nsys_profile):
        return frozenset(), frozenset()
    last = pc.profile_step_end + (1 if pc.use_pytorch_profiler else 0)
    after = {last + 1} if pc.use_pytorch_profiler and world_size > 1 else set()
    return frozenset(range(pc.profile_step_start, last + 1)), frozenset(after)


def steps_text(steps: Iterable[int]) -> str:
    """Step numbers in words, runs of three or more as ranges: "2, 6-10"."""
    s = sorted(set(steps))
    runs: list[list[int]] = []
    for step in s:
        if runs and step == runs[-1][-1] + 1:
            runs[-1].append(step)
        else:
            runs.append([step])
    return ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ", ".join(map(str, r)) for r in runs)


def step_list(steps: Iterable[int], noun: str = "step") -> str:
    """"step 4", "steps 2-4", "profiled steps 3-5"."""
    steps = sorted(set(steps))
    return f"{noun}{'s' if len(steps) != 1 else ''} {steps_text(steps)}"
