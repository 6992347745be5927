"""Memory measured on the CPU: the probes' census of tensor storages (probes.memory.tensor_census) and the static
memory rows it feeds (ledger.reconcile.memory).

The census itself is tested in this process on tensors whose sizes are known; the rows' claims on a committed real
run (tests/fixtures/gloo_dp2_census, its README gives the command): two gloo ranks, bf16 params with fp32 grads, the
distributed optimizer over five padded buckets, so that the two ranks' shards differ.
"""
from __future__ import annotations

import gc
import json
import shutil
from pathlib import Path

import pytest
import torch

from ledger.reconcile.rows import NOT_ON_CPU
from ledger.reconcile.run import reconcile
from probes.memory import MemoryProbe, storage_bytes, tensor_census

FIXTURES = Path(__file__).parent / "fixtures"
CENSUS_RUN = FIXTURES / "gloo_dp2_census"
STATIC = ("memory.static_after_optimizer_init", "memory.static_after_first_step", "memory.adam_lazy_state",
          "memory.bytes_per_param")
# The tiny model's parameter tensors (4 layers x 6, embedding, final norm; tied output) and the run's buckets: each
# bucket edge may cut one parameter into two pieces, and torch's Adam keeps one 4-byte step counter per piece.
PARAM_TENSORS, BUCKETS = 4 * 6 + 2, 5


def rows(result, metric: str) -> dict[int, object]:
    return {r.rank: r for r in result.rows if r.metric == metric}


def copied(tmp_path: Path, name: str) -> Path:
    run = tmp_path / name
    shutil.copytree(FIXTURES / name, run)
    return run


def rewrite_point(run: Path, rank: int, point: str, key: str, factor: float) -> None:
    """Scale one field of one lifecycle point's memory record: a census that measured something else."""
    path = run / "ranks" / f"rank{rank}" / "events.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    for r in records:
        if r["kind"] == "memory" and r.get("point") == point:
            r[key] = int(r[key] * factor)
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


# --- the census -------------------------------------------------------------------------------------------------
def test_a_storage_counts_once_however_many_views_share_it() -> None:
    buffer = torch.zeros(1000)  # 4,000 bytes: a DDP buffer with parameters as views into it
    views = [buffer[:10], buffer[500:], buffer.view(10, 100)]
    other = torch.zeros(10, dtype=torch.float64)  # 80 bytes of its own
    assert storage_bytes([buffer, *views]) == (4000, 1)
    assert storage_bytes([*views, other]) == (4080, 2)  # a view counts its whole storage, padding included


def test_census_finds_a_new_tensor_and_what_the_engine_holds() -> None:
    gc.collect()  # no garbage cycle left to be freed between the two counts
    before = tensor_census()
    kept = torch.empty(1000, dtype=torch.float64)
    after = tensor_census(lambda: [kept[:5]])
    assert after["tensor_bytes"] - before["tensor_bytes"] == 8000
    assert after["tensor_storages"] - before["tensor_storages"] == 1
    assert (after["held_tensor_bytes"], after["held_tensor_storages"]) == (8000, 1)
    assert "held_tensor_bytes" not in before  # only what the engine says it holds is "held"


def test_cpu_lifecycle_points_carry_the_census_and_steps_do_not() -> None:
    probe = MemoryProbe(use_cuda=False)
    held = torch.zeros(3)
    point = probe.read_point(lambda: [held])
    assert point["device"] == "cpu" and point["rss_bytes"] > 0 and point["held_tensor_bytes"] == 12
    assert point["tensor_bytes"] >= point["held_tensor_bytes"]
    assert "tensor_bytes" not in probe.read_step()  # one pass over every object is for the four points only


# --- the rows, on a real run --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def census(tmp_path_factory):
    return reconcile(copied(tmp_path_factory.mktemp("census"), "gloo_dp2_census"))


def test_static_rows_are_measured_on_cpu_with_their_source(census) -> None:
    for metric in STATIC:
        by_rank = rows(census, metric)
        assert sorted(by_rank) == [0, 1], metric
        for r in by_rank.values():
            assert r.measured is not None and r.source == "tensor_census", (metric, r)
            assert r.verdict == "ok" and NOT_ON_CPU not in r.explanation, (metric, r)


def test_census_equals_the_formula_before_adam_has_state(census) -> None:
    # After optimizer init the rank holds the bf16 param buffer, the fp32 grad buffer (padding included) and the
    # fp32 main params of its shard, nothing else: the census finds exactly the formula's bytes, on both ranks,
    # although their shards differ.
    init = rows(census, "memory.static_after_optimizer_init")
    assert {rank: r.measured - r.predicted for rank, r in init.items()} == {0: 0, 1: 0}
    assert init[0].measured != init[1].measured


def test_after_the_step_the_census_adds_only_adams_step_counters(census) -> None:
    for rank, r in rows(census, "memory.static_after_first_step").items():
        gap = r.measured - r.predicted
        assert gap % 4 == 0 and 0 < gap <= 4 * (PARAM_TENSORS + BUCKETS), (rank, gap)
        assert "4-byte step counter" in r.explanation


def test_other_live_tensors_are_named_not_counted(census) -> None:
    for rank, r in rows(census, "memory.static_after_first_step").items():
        events = map(json.loads, (CENSUS_RUN / "ranks" / f"rank{rank}" / "events.jsonl").read_text().splitlines())
        record = next(e for e in events if e["kind"] == "memory" and e["point"] == "after_first_step")
        other = record["tensor_bytes"] - record["held_tensor_bytes"]
        assert other > 0 and f"held {other:,} B more in other live tensors" in r.explanation


@pytest.mark.parametrize("point, factor, metrics", [
    ("after_first_step", 1.05, ("memory.static_after_first_step", "memory.bytes_per_param",
                                "memory.adam_lazy_state")),
    ("after_optimizer_init", 0.9, ("memory.static_after_optimizer_init", "memory.adam_lazy_state")),
])
def test_a_census_that_disagrees_is_off(tmp_path, point, factor, metrics) -> None:
    run = copied(tmp_path, "gloo_dp2_census")
    rewrite_point(run, 0, point, "held_tensor_bytes", factor)
    result = reconcile(run)
    for metric in metrics:
        by_rank = rows(result, metric)
        assert (by_rank[0].verdict, by_rank[1].verdict) == ("off", "ok"), metric


def test_a_cpu_run_recorded_before_the_census_says_not_measured(tmp_path) -> None:
    result = reconcile(copied(tmp_path, "gloo_pp2"))  # RSS only at its lifecycle points
    for r in rows(result, "memory.static_after_first_step").values():
        assert r.measured is None and NOT_ON_CPU in r.explanation and r.source == "events"
