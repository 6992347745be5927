"""Which group each traced collective ran on: gloo records no process group, so the ledger names it from the evidence
the trace and the run directory hold (ledger.evidence.trace_groups); checked on the recorded gloo runs, whose
answers follow from their configurations."""
from __future__ import annotations

from pathlib import Path

import pytest

from common.config import RunConfig
from ledger.evidence.layout import group_kind
from ledger.evidence.read import read_run
from ledger.evidence.run import RankEvidence
from ledger.evidence.trace_groups import attribute_groups, range_kinds
from ledger.evidence.traces import Collective, TraceSummary, summarize
from ledger.reconcile.comm import predicted_volume, trace_volume, volume_rows
from tests.support.records import typed

FIXTURES = Path(__file__).parent / "fixtures"
RANGE = {"name": "tp all-reduce", "category": "tp-comm", "start_s": 0.0, "end_s": 1.0}  # one timing record
PP2_GROUPS = {"tp": (1,), "dp": (1,), "pp": (0, 1), "embedding": (0, 1)}


def attributed(name: str, rank: int = 0):
    run = FIXTURES / name
    ev = read_run(run)
    groups = ev.groups(rank)
    trace = next((run / "traces").glob(f"rank{rank}.*"))
    return ev.manifest, groups, attribute_groups(summarize(trace), groups, ev.world_size,
                                                 range_kinds(ev.ranks[rank].timing))


def test_under_pp2_the_shared_group_is_the_embeddings_only_for_its_grad_all_reduce():
    """PP2 makes the embedding group (first and last stage) the pipeline group's ranks. Only the tied embedding's grad
    all-reduce belongs to the embedding; point-to-point, the loss broadcast and any all-reduce the evidence shows was
    issued outside the embedding's range are the pipeline group's. Without evidence (an NCCL kernel names its ranks
    but not why it ran) an all-reduce there is taken as the embedding grads'."""
    assert group_kind(PP2_GROUPS, (0, 1), "all_reduce", "embedding") == "embedding"
    assert group_kind(PP2_GROUPS, (0, 1), "all_reduce", "") == "pp"
    assert group_kind(PP2_GROUPS, (0, 1), "broadcast") == "pp"
    assert group_kind(PP2_GROUPS, (0, 1), "send_recv") == "pp"
    assert group_kind(PP2_GROUPS, (0, 1), "all_reduce") == "embedding"
    assert group_kind(PP2_GROUPS, None, "all_reduce") == "unknown"


def test_the_recorded_pp2_run_names_every_collectives_group():
    """gloo_pp2, stage 0 of 2, tied embeddings, 4 micro-batches of [32, 1, 64] bf16: per step it sends 4 activations
    and receives 4 grads (8 x 32 x 64 x 2 bytes), all-reduces its copy of the embedding's fp32 grad (1000 x 64 x 4)
    over the embedding group, and takes part in the grad norm's all-reduce and the loss broadcast (one fp32 each) on
    the pipeline's ranks."""
    manifest, groups, result = attributed("gloo_pp2")
    assert groups == {"tp": (0,), "dp": (0,), "pp": (0, 1), "embedding": (0, 1), "mp": (0, 1)}  # mp: tp x pp
    volume = trace_volume(result.summary, groups, 2)
    assert volume == {("pp", "send_recv"): 8 * 32 * 64 * 2, ("embedding", "all_reduce"): 1000 * 64 * 4,
                      ("pp", "all_reduce"): 4, ("pp", "broadcast"): 4}
    cfg = RunConfig.from_dict(manifest["config"])
    assert volume[("embedding", "all_reduce")] == predicted_volume(cfg, 0)[("embedding", "all_reduce")]
    assert result.named_by == {"point-to-point": 24, "issuing range": 3, "only group of several ranks": 6}


def test_the_recorded_dp2_run_puts_its_bucket_collectives_on_the_dp_group():
    """gloo_dp2_overlap: DP2 is the run's only group of more than one rank, so every collective ran there (a group of
    one, the grad norm's model-parallel group, moves nothing, but gloo records no group to tell it apart: its 4 bytes
    count on DP too). The buckets' reduce-scatters and all-gathers move the whole buffers, as the formula says."""
    manifest, groups, result = attributed("gloo_dp2_overlap")
    volume = trace_volume(result.summary, groups, 2)
    predicted = predicted_volume(RunConfig.from_dict(manifest["config"]), 0)
    assert predicted[("dp", "reduce_scatter")] == 156544 * 4 and predicted[("dp", "all_gather")] == 156544 * 2
    assert volume == {("dp", "reduce_scatter"): 156544 * 4, ("dp", "all_gather"): 156544 * 2,
                      ("dp", "all_reduce"): 3 * 4}
    # the all-gathers the forward's pre-hooks issue while waiting (a dp-wait range) name the DDP group's two worker
    # threads, and so every bucket collective and the grad norm's DP all-reduce on them; the loss's all-reduce and
    # the model-parallel grad norm run on other groups' threads, named by elimination
    assert result.named_by == {"issuing range": 6, "worker thread": 15, "only group of several ranks": 6}


def test_a_rank_in_several_groups_names_only_what_the_evidence_names(tmp_path):
    """Plumbing, on a hand-built summary: rank 0 of TP2 x DP2 is in tp (0, 1) and dp (0, 2). A collective issued in a
    TP range is TP's, and so is the rest of its worker thread's work (one process group per thread); one issued
    outside any range on another thread stays unnamed: no rule may guess between two groups."""
    groups = {"tp": (0, 1), "dp": (0, 2), "pp": (0,)}
    summary = TraceSummary(path=tmp_path / "t.json", rank=0, world_size=4, backend="gloo", collectives=[
        Collective("all_reduce", 0, 1, 64, None, thread=7, issued_in="tp all-reduce"),
        Collective("all_reduce", 2, 3, 64, None, thread=7, issued_in="optimizer"),
        Collective("all_reduce", 4, 5, 4, None, thread=9, issued_in="optimizer"),
        Collective("send", 6, 7, None, None, thread=1, issued_in="send_forward")])
    result = attribute_groups(summary, groups, 4, range_kinds(typed("timing", [RANGE])))
    assert [c.group for c in result.summary.collectives] == [(0, 1), (0, 1), None, None]
    assert [group_kind(groups, c.group, c.op, c.issued_as) for c in result.summary.collectives[:3]] == \
        ["tp", "tp", "unknown"]
    assert result.named_by == {"issuing range": 1, "worker thread": 1, "none": 1, "point-to-point": 1}


def test_volume_rows_fall_back_to_totals_per_op_only_for_ops_with_unnamed_collectives():
    """Plumbing: an unnamed all-reduce must not turn the named reduce-scatter's row into a per-op total."""
    r = RankEvidence(rank=0, coords={"tp": 0, "cp": 0, "dp": 0, "pp": 0})
    rows = volume_rows(None, r, {("dp", "reduce_scatter"): 100.0, ("unknown", "all_reduce"): 4.0})
    assert sorted(x.metric for x in rows) == ["comm.dp.reduce_scatter.bytes_per_step",
                                              "comm.unknown.all_reduce.bytes_per_step"]


def _gloo_run(run: Path) -> Path:
    """TP2 x DP2 of the tiny model, SP, the distributed optimizer with both overlaps and small buckets (several
    per rank, each run by whichever of its group's two gloo worker threads is free), timers and the profiler."""
    import os
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-m", "cli.main", "train", "--nproc-per-node", "4", "--model", "tiny",
         "--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer",
         "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "10000", "--micro-batch-size", "1",
         "--global-batch-size", "4", "--train-iters", "3", "--timers", "--use-pytorch-profiler",
         "--profile-step-start", "2", "--profile-step-end", "2", "--profile-ranks", "0", "1", "2", "3",
         "--run-dir", str(run)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stderr[-3000:]
    return run


@pytest.mark.slow
def test_two_identical_gloo_runs_name_every_collective_by_its_issuing_range_and_give_one_row_set(tmp_path):
    """The engine issues every collective inside a range that names its group (an async one included: its issue
    runs inside a record_function of its range), so no collective waits on which worker thread ran it: the same
    flags give the same row set, and no row is an "unknown" group's."""
    from ledger.reconcile.hta import HtaChoice
    from ledger.reconcile.run import TraceWork, reconcile

    keys = []
    for name in ("first", "second"):
        run = _gloo_run(tmp_path / name)
        ev = read_run(run)
        for rank in range(4):
            trace = next((run / "traces").glob(f"rank{rank}.*"))
            named = attribute_groups(summarize(trace), ev.groups(rank), 4, range_kinds(ev.ranks[rank].timing)).named_by
            assert set(named) <= {"issuing range", "point-to-point"}, (name, rank, named)
        rows = reconcile(run, TraceWork(hta=HtaChoice.parse("none"))).rows  # HTA's cross-check is not judged here
        assert not [r.metric for r in rows if ".unknown" in r.metric or "_unknown_" in r.metric]
        keys.append(sorted({(r.metric, r.rank, r.bucket, r.source) for r in rows}, key=str))
    assert keys[0] == keys[1]
