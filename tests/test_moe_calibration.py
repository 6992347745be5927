"""Calibration of the expert-parallel and context-parallel time rows, and the check of the expert groups.

The start-up bandwidth sweep (probes/bandwidth.py) times all_to_all on the "ep" group at one micro-batch's dispatch
size, the expert buckets' collectives on "expt_dp", and the CP ring's send_recv on "cp"; the ledger's
`time.ep_all_to_all_per_step` (ledger/reconcile/moe.py) prices the all-to-alls with the "ep" fit, and the topology
check (ledger/reconcile/topology.py) holds the engine's expert groups against Megatron's expert grid.

Claims about measurements are made on one real run, shared by the slow tests here: the engine on 2 gloo ranks, the
tiny shape with 4 experts, top-2, EP2, --timers --bandwidth-sweep. The sweep's own plumbing on the other groups is
checked on real gloo ranks without a model; the topology cases are synthetic manifests (plumbing, said so there).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.arguments import parse_args
from common.rank_info import parse_rank_infos
from ledger.evidence.read import read_run
from ledger.evidence.run import RunEvidence
from ledger.models.formulas.device_memory import communicators
from ledger.reconcile.moe import TIME_FLOOR_S, TIME_TOL, exchange_seconds, moe_rows
from ledger.reconcile.rows import WARN_FACTOR, judge
from ledger.reconcile.run import reconcile, run_steps
from ledger.reconcile.time_rows import predict_run
from ledger.reconcile.topology import groups_rows
from tests.conftest import EP2_FLAGS
from tests.support.gloo import run_distributed
from tests.support.moe_evidence import PREDICTED_S, evidence, model
from tests.support.records import typed

SEQ, HIDDEN, TOPK, FP32 = 32, 64, 2, 4  # the tiny shape, fp32


def records(run: Path, rank: int, kind: str) -> list[dict]:
    lines = (run / "ranks" / f"rank{rank}" / "events.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r.get("kind") == kind]


def pick(rows, metric: str, rank: int):
    (found,) = [r for r in rows if r.metric == metric and r.rank == rank]
    return found


@pytest.mark.slow
def test_the_sweep_times_the_dispatch_all_to_all_on_the_ep_group(ep2_run):
    # one micro-batch's dispatch: s x b tokens, top-2 rows each of h fp32 values: 32 x 2 x 64 x 4 = 16 KiB; and the
    # latency point, one element per rank
    dispatch = SEQ * 1 * TOPK * HIDDEN * FP32
    for rank in (0, 1):
        ep = [r for r in records(ep2_run, rank, "bandwidth") if r["group"] == "ep"]
        assert {(r["collective"], r["size_bytes"]) for r in ep} == {("all_to_all", dispatch), ("all_to_all", 2 * FP32)}
        for r in ep:
            assert r["group_size"] == 2 and r["ranks"] == [0, 1]
            assert r["busbw_GBps"] == pytest.approx(r["algbw_GBps"] / 2)  # all-to-all: (n - 1) / n
        # the expert buffers are reduced over expert-dp, a group of one here: none of their buckets is swept on dp
        expert = {b["numel"] * FP32 for r in records(ep2_run, rank, "inventory") if r.get("expert")
                  for b in r["buckets"]}
        swept = {r["size_bytes"] for r in records(ep2_run, rank, "bandwidth")}
        assert expert and not expert & swept
        assert not [r for r in records(ep2_run, rank, "bandwidth") if r["group"] == "expt_dp"]


@pytest.mark.slow
def test_the_all_to_all_time_is_judged_on_the_exchange_and_the_wait_is_shown(ep2_run):
    """The row is judged (a prediction from the ep sweep's fit beside a measurement), its measurement is the steady
    steps' exchange time read from the ranges, and the rest of the ranges' time is the wait row. On 2 shared CPU
    cores the verdict itself is no evidence either way (a gloo call's latency swings with the scheduler, in the sweep
    and in the run alike): the test holds what is measured and predicted and that the verdict judges the one against
    the other at the row's bar (25% or 2 ms), not how close they came."""
    result = reconcile(ep2_run)
    ev = read_run(ep2_run)
    exchange = exchange_seconds(ev.config, ev)
    assert set(exchange[0]) == set(exchange[1]) == {1, 2, 3, 4}
    assert exchange[0] == exchange[1]  # one exchange per call for the whole EP group
    for rank in (0, 1):
        judged = pick(result.rows, "time.ep_all_to_all_per_step", rank)
        wait = pick(result.rows, "time.ep_all_to_all_wait_per_step", rank)
        assert judged.predicted is not None and "alpha" in judged.explanation  # the ep sweep's fit
        assert judged.verdict == judge(judged.measured, judged.predicted, TIME_TOL, TIME_FLOOR_S)[2]
        steps = run_steps(ev).timed(set(exchange[rank]))[0]
        assert judged.measured == pytest.approx(sum(exchange[rank][s] for s in steps) / len(steps))
        assert wait.verdict == "n/a" and wait.measured >= 0


@pytest.mark.slow
def test_a_wrong_exchange_time_is_off(ep2_run):
    """Every exchange returning later, by enough that the step's exchange time lies twice the warn band above the
    prediction, is off, whatever the clean run's verdict was."""
    ev = read_run(ep2_run)
    model, selection = predict_run(ev), run_steps(ev)
    clean = pick(moe_rows(ev, model, selection), "time.ep_all_to_all_per_step", 0)
    calls = sum(1 for t in ev.ranks[0].timing if t.category == "ep-comm" and "counts" not in t.name
                and t.step == 2)
    band = WARN_FACTOR * max(TIME_FLOOR_S, TIME_TOL * clean.predicted)
    late = (max(0.0, clean.predicted - clean.measured) + 2 * band) / calls
    for r in ev.ranks.values():
        for t in r.timing:
            if t.category == "ep-comm":
                t.t_end += late
                t.duration_s += late
    wrong = pick(moe_rows(ev, model, selection), "time.ep_all_to_all_per_step", 0)
    assert wrong.measured == pytest.approx(clean.measured + late * calls, rel=1e-3)
    assert wrong.verdict == "off"


@pytest.mark.slow
def test_the_engines_expert_groups_are_megatrons_and_those_of_two_ranks_hold_a_communicator(ep2_run):
    ev = read_run(ep2_run)
    manifest = ev.manifest
    rows = groups_rows(ev)
    assert [(r.rank, r.measured, r.verdict) for r in rows] == [(0, 0, "ok"), (1, 0, "ok")]
    cfg = parse_args([*EP2_FLAGS, "--world-size", "2"])
    for entry in manifest["ranks"]:
        # 8 dense kinds + ep, expt_dp, expt_mp, of which dp, dp_cp, ep and expt_mp span both ranks: the
        # device-memory formula's communicators, the default one aside
        assert {"ep", "expt_dp", "expt_mp"} <= set(entry["groups"]) and len(entry["groups"]) == 11
        shared = sorted(kind for kind, ranks in entry["groups"].items() if len(ranks) > 1)
        assert shared == ["dp", "dp_cp", "ep", "expt_mp"]
        assert len(shared) == communicators(cfg, entry["rank"]) - 1


def test_waiting_for_a_late_peer_is_shown_apart_from_the_exchange():
    """Plumbing (test_moe_rows' synthetic EP2 evidence, given wall-clock times): rank 0 enters every all-to-all 1 ms
    before rank 1, then both take the exchange's time, the link fit's prediction; rank 0's ranges hold the wait."""
    ev, skew = evidence(), 1e-3
    for rank, r in ev.ranks.items():
        for t in r.timing:
            early = skew if rank == 0 and "counts" not in t.name else 0.0
            t.t_start, t.t_end, t.duration_s = t.start_s - early, t.end_s, (t.duration_s or 0.0) + early
    rows = moe_rows(ev, model(), run_steps(ev))
    for rank, waited in ((0, 16 * skew), (1, 0.0)):  # 16 dispatch / combine all-to-alls a step
        judged = pick(rows, "time.ep_all_to_all_per_step", rank)
        assert judged.measured == pytest.approx(PREDICTED_S) and judged.verdict == "ok"
        assert pick(rows, "time.ep_all_to_all_wait_per_step", rank).measured == pytest.approx(waited, abs=1e-9)


# --- the sweep on the other groups: real gloo ranks, no model ------------------------------------------------------
def sweep_layouts(rank: int, world_size: int) -> dict[str, list[dict]]:
    """The sweep alone at two 2-rank layouts: experts with EP1 (expert-dp 2, ep a group of one), and CP2."""
    import torch

    from engine.parallel_state import ParallelState
    from probes.bandwidth import Sweep, SweepSizes

    out = {}
    for name, ps, sizes in (
            ("expert_dp", ParallelState.initialize(ep=1, moe=True),
             SweepSizes(dp_bucket_numels=[100], expert_bucket_numels=[301, 301], ep_dispatch_numel=64)),
            ("cp", ParallelState.initialize(cp=2), SweepSizes(cp_message_numels=[48, 96], activation_dtype="bf16"))):
        sweep = Sweep(ps, torch.device("cpu"), warmup=1, iters=1)
        out[name] = sweep.run(sizes) + sweep.run(sizes.latency())
    return out


@pytest.mark.slow
def test_expert_buckets_sweep_on_expert_dp_and_the_cp_ring_on_cp():
    for per_layout in run_distributed(sweep_layouts, 2):
        expert = {(r["group"], r["collective"], r["numel"]) for r in per_layout["expert_dp"]}
        # dense buckets on dp x cp, expert buckets (301 padded to 302) on expt_dp, each with its latency point;
        # no all_to_all: the ep group has one rank
        assert expert == {(g, c, n) for g, n in (("dp", 100), ("dp", 2), ("expt_dp", 302), ("expt_dp", 2))
                          for c in ("reduce_scatter", "all_gather", "all_reduce")}
        cp = per_layout["cp"]
        assert {(r["group"], r["collective"], r["size_bytes"]) for r in cp} == {
            ("cp", "send_recv", 2 * 48), ("cp", "send_recv", 2 * 96), ("cp", "send_recv", 2 * 1)}  # bf16
        assert all(r["ranks"] == [0, 1] and r["busbw_GBps"] == r["algbw_GBps"] for r in cp)


# --- the topology check of the expert groups (plumbing: synthetic manifests) ---------------------------------------
def moe_manifest(groups_of_rank1: dict[str, list[int]], experts: int | None = 4) -> RunEvidence:
    """World 4, EP2: Megatron's expert grid tp-ep-dp-pp puts ranks 0, 1 in an EP group and 1, 3 in an expert-dp
    group; the dense grid has one DP group of all four."""
    flags = ["--model", "tiny", "--global-batch-size", "4", "--world-size", "4"]
    if experts:
        flags += ["--num-experts", str(experts), "--expert-model-parallel-size", "2"]
    entries = [{"rank": 1, "groups": groups_of_rank1}]
    return RunEvidence(run_dir=Path("."), manifest={"world_size": 4, "ranks": entries}, config=parse_args(flags),
                       ranks={}, traces=[], rank_infos=parse_rank_infos(entries))


DENSE_RANK1 = {"tp": [1], "cp": [1], "dp": [0, 1, 2, 3], "dp_cp": [0, 1, 2, 3], "pp": [1], "mp": [1],
               "embedding": [1], "position": [1]}
EXPERT_RANK1 = {"ep": [0, 1], "expt_dp": [1, 3], "expt_mp": [0, 1]}


def test_the_expert_groups_are_checked_against_megatrons_expert_grid():
    (ok,) = groups_rows(moe_manifest({**DENSE_RANK1, **EXPERT_RANK1}))
    assert (ok.measured, ok.verdict) == (0, "ok") and "11 process groups" in ok.explanation


@pytest.mark.parametrize("groups, named", [
    ({**DENSE_RANK1, **EXPERT_RANK1, "ep": [1, 3]}, "ep [1, 3] (Megatron's rule: [0, 1])"),
    ({**DENSE_RANK1, **EXPERT_RANK1, "expt_dp": [0, 1]}, "expt_dp [0, 1] (Megatron's rule: [1, 3])"),
    ({**DENSE_RANK1, "expt_dp": [1, 3], "expt_mp": [0, 1]}, "ep not recorded"),
])
def test_a_wrong_or_missing_expert_group_is_off(groups, named):
    (wrong,) = groups_rows(moe_manifest(groups))
    assert (wrong.measured, wrong.verdict) == (1, "off") and named in wrong.explanation


def test_expert_groups_in_a_dense_run_are_off():
    (wrong,) = groups_rows(moe_manifest({**DENSE_RANK1, **EXPERT_RANK1}, experts=None))
    assert (wrong.measured, wrong.verdict) == (3, "off") and "the config has no experts" in wrong.explanation


def test_an_expert_buckets_comm_time_is_priced_on_expert_dp():
    """Synthetic evidence (plumbing): one dense and one expert bucket of the same size; the sweep has dp at 1 GB/s and
    expt_dp at 4 GB/s, so the expert bucket's predicted comm time is a quarter of the dense one's."""
    from ledger.evidence.run import RankEvidence
    from ledger.reconcile.overlap import bucket_rows, timer_intervals

    nbytes = 8_000_000
    sweep = [{"group": "dp", "collective": "reduce_scatter", "group_size": 2, "size_bytes": nbytes,
              "time_s": nbytes / 1e9},
             {"group": "expt_dp", "collective": "reduce_scatter", "group_size": 2, "size_bytes": nbytes,
              "time_s": nbytes / 4e9}]
    timing = [{"step": 2, "category": "dp-comm", "name": f"reduce-scatter bucket{b}", "bucket": b, "bytes": nbytes,
               "start_s": 1.0, "end_s": 1.01, "async_comm": True, **({"expert": True} if b == 1 else {})}
              for b in (0, 1)]
    r = RankEvidence(rank=0, coords={"pp": 0}, timing=typed("timing", timing), bandwidth=typed("bandwidth", sweep))
    rows = bucket_rows(None, r, timer_intervals(r), "timers", steps=[2])
    comm = {row.bucket: row.predicted for row in rows if row.metric == "overlap.reduce_scatter.comm_time"}
    assert comm == pytest.approx({0: 8e-3, 1: 2e-3})
