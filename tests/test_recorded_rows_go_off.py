"""Each judged row of a real recorded run turns "off" when its measurement is made wrong, and is not "off" as
recorded: the row judges the measurement, not a prediction built from it.

A test that a clean run agrees cannot tell a predictor that returns the measurement (or a tolerance widened without
bound) from a good one: both agree. These rows had no other test that fails under either mutation
(`python3 runs/audit/row_mutations.py` makes each row's prediction its own measurement, verdict ok, and names the
first test that fails); each case here fails under it. The corruption is applied to the run's evidence as read, so
the recorded files stay as they are.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import pytest

from common.events import ALLOCATED, PEAK
from ledger.evidence.megatron.ingest import THROUGHPUT, TIMERS
from ledger.evidence.read import read_run
from ledger.evidence.run import RunEvidence
from ledger.evidence.traces import normalize_op
from ledger.models.simulate.hardware import load_hardware
from ledger.reconcile.rows import Row
from ledger.reconcile.run import TimeSources, reconcile_evidence
from tests.support.recorded_runs import FIXTURES, WITHOUT_HTA

H200 = TimeSources(hardware=load_hardware("H200"))  # a Megatron-LM run has no sweeps: priced from its GPU's file


def scaled_scalar(key: str, factor: float, name: str | None = None) -> Callable[[RunEvidence], None]:
    """Megatron-LM's TensorBoard scalar (the throughput, or the timer `name`) `factor` times what was logged."""
    def apply(ev: RunEvidence) -> None:
        values = ev.manifest[key] if name is None else ev.manifest[key][name]
        for step in values:
            values[step] *= factor
    return apply


def added_to_timer(name: str, seconds: float) -> Callable[[RunEvidence], None]:
    """`seconds` more in Megatron-LM's timer `name` at every iteration (a figure predicted near zero)."""
    def apply(ev: RunEvidence) -> None:
        values = ev.manifest[TIMERS][name]
        for step in values:
            values[step] += seconds
    return apply


def scaled_memory(key: str, factor: float) -> Callable[[RunEvidence], None]:
    """Every step's memory_stats figure `key` `factor` times what was recorded."""
    def apply(ev: RunEvidence) -> None:
        for r in ev.ranks.values():
            for m in r.memory_steps:
                if key in m.stats:
                    m.stats[key] = int(m.stats[key] * factor)
    return apply


def stretched_collectives(op: str, factor: float) -> Callable[[RunEvidence], None]:
    """Every traced collective of `op` `factor` times as long (the run's trace summaries, read once and kept)."""
    def apply(ev: RunEvidence) -> None:
        for summary in ev.trace_summaries().values():
            for c in summary.collectives:
                if c.op == op:
                    c.end = c.start + (c.end - c.start) * factor
    return apply


def scaled_bytes(op: str, factor: float) -> Callable[[RunEvidence], None]:
    """Every timed collective of `op` counted `factor` times its bytes (the engine's counters)."""
    def apply(ev: RunEvidence) -> None:
        for r in ev.ranks.values():
            for t in r.timing:
                if t.bytes is not None and normalize_op(t.name) == op:
                    t.bytes = int(t.bytes * factor)
    return apply


@dataclass(frozen=True)
class Case:
    run: str  # under tests/fixtures
    metric: str
    where: dict
    corrupt: Callable[[RunEvidence], None]
    sources: TimeSources = TimeSources()

    def row(self, corrupted: bool) -> Row:
        ev = read_run(FIXTURES / self.run)
        if corrupted:
            self.corrupt(ev)
        rows = reconcile_evidence(ev, WITHOUT_HTA, self.sources).rows
        found = [r for r in rows if r.metric == self.metric and all(getattr(r, k) == v for k, v in self.where.items())]
        assert len(found) == 1, (self.metric, self.where, found)
        return found[0]


MEGATRON_1GPU, MEGATRON_SDPA = "megatron_lm_1gpu", "megatron_lm_h200/sdpa_l4_mbs2"
CASES = {
    "Megatron's FLOP count": Case(MEGATRON_1GPU, "megatron.flops_per_step", {}, scaled_scalar(THROUGHPUT, 1.1),
                                  H200),
    "Megatron's throughput": Case(MEGATRON_SDPA, "megatron.throughput", {}, scaled_scalar(THROUGHPUT, 1.5), H200),
    "Megatron's forward-backward timer": Case(MEGATRON_SDPA, "megatron.timer.forward-backward", {},
                                              scaled_scalar(TIMERS, 1.5, "forward-backward"), H200),
    "Megatron's gradient sync timer": Case(MEGATRON_SDPA, "megatron.timer.all-grads-sync", {},
                                           added_to_timer("all-grads-sync", 0.05), H200),
    "Megatron's optimizer timer": Case(MEGATRON_SDPA, "megatron.timer.optimizer", {},
                                       scaled_scalar(TIMERS, 2.0, "optimizer"), H200),
    "Megatron's parameter all-gather timer": Case(MEGATRON_SDPA, "megatron.timer.params-all-gather", {},
                                                  added_to_timer("params-all-gather", 0.05), H200),
    "allocated between steps": Case(MEGATRON_SDPA, "memory.allocated_after_step", {},
                                    scaled_memory(ALLOCATED, 1.1), H200),
    "the peak above the allocated": Case(MEGATRON_SDPA, "memory.peak_above_allocated", {},
                                         scaled_memory(PEAK, 1.2), H200),
    "all-gather time (trace)": Case("gloo_dp2_sweeps", "overlap.all_gather.comm_time",
                                    dict(rank=0, bucket=0, source="trace"), stretched_collectives("all_gather", 4.0)),
    "all-gather exposed time (trace)": Case("gloo_dp2_sweeps", "overlap.all_gather.exposed_time",
                                            dict(rank=0, bucket=2, source="trace"),
                                            stretched_collectives("all_gather", 4.0)),
    "exposed embedding communication (trace)": Case("gloo_pp2_sweeps", "overlap.exposed_embedding_comm_per_step",
                                                    dict(rank=0, source="trace"),
                                                    stretched_collectives("all_reduce", 3.0)),
    # a thousand times as long: it runs on far past the step's compute, most of it exposed
    "all-gather overlapped fraction (trace)": Case("gloo_dp2_sweeps", "overlap.all_gather.overlapped_fraction",
                                                   dict(rank=0, bucket=0, source="trace"),
                                                   stretched_collectives("all_gather", 1e3)),
    "all-gather bytes (counters)": Case("gloo_dp2_sweeps", "comm.dp.all_gather.bytes_per_step", dict(rank=1),
                                        scaled_bytes("all_gather", 2.0)),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_recorded_row_goes_off_when_its_measurement_is_wrong(name):
    case = CASES[name]
    assert case.row(corrupted=False).verdict != "off"
    wrong = case.row(corrupted=True)
    assert wrong.verdict == "off", wrong
