"""Checkpoint bytes per rank (ledger.models.formulas.checkpoint), the reconciliation's checkpoint rows and the report's
resume line.

The tiny model at --num-layers 2 (hidden 64, FFN 176 with SwiGLU, 8 heads in 4 query groups of 8, vocabulary 1000,
tied embeddings, RMSNorm without bias), from first principles:
    embedding 1000 x 64 = 64,000; per layer: two norms 2 x 64, QKV 64 x (64 + 2 x 32) = 8,192, output projection
    64 x 64 = 4,096, fc1 64 x 2 x 176 = 22,528, fc2 176 x 64 = 11,264, so 46,208; the final norm 64.
    14 tensors, 64,000 + 2 x 46,208 + 64 = 156,480 elements, every one a multiple of 64 (no alignment padding
    between parameters).
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from common.arguments import parse_args
from ledger.evidence.run import RankEvidence, RunEvidence
from ledger.models.formulas.checkpoint import (
    TORCH_CPU_RNG_STATE_BYTES,
    checkpoint_bytes,
)
from ledger.present.report_view import resumed
from ledger.reconcile.checkpoint import checkpoint_rows
from ledger.reconcile.run import reconcile
from tests.support.records import typed

TINY = ["--model", "tiny", "--num-layers", "2", "--micro-batch-size", "1", "--mock-data"]
DP2_DISTOPT_BF16 = TINY + ["--global-batch-size", "4", "--use-distributed-optimizer", "--bf16"]
PARAMS = 156_480
TENSORS = 14


def test_dp2_distributed_optimizer_bf16_file_per_rank():
    """One bucket (no --overlap-grad-reduce), its end rounded up to lcm(2, 128): 156,544 elements, 64 of padding.
    Each DP rank owns 78,272 of them; rank 1's half holds the padding. Laid out in reverse order (final norm first),
    rank 0's shard ends inside layer 0's fc1 (at 57,536 + 22,528 > 78,272): 9 pieces, and rank 1 has the rest of
    fc1 and the 5 tensors before it: 6 pieces."""
    cfg = parse_args(DP2_DISTOPT_BF16, world_size=2)
    buffer = 156_544 * 2  # bf16 param buffer, padding included
    for dp_rank, owned, pieces in ((0, 78_272, 9), (1, 78_272 - 64, 6)):
        got = checkpoint_bytes(cfg, 0, 0, dp_rank)
        assert (got.param_buffers, got.main_params, got.adam_m, got.adam_v) == (buffer, owned * 4, owned * 4,
                                                                                 owned * 4)
        assert got.adam_step == pieces * 4 and got.rng == TORCH_CPU_RNG_STATE_BYTES
        assert got.tensors == 1 + 1 + 3 * pieces + 1  # buffer, main params, m / v / step per piece, CPU RNG
        assert got.total == buffer + 3 * owned * 4 + pieces * 4 + 5056
    assert checkpoint_bytes(cfg, 0, 0, 0).total == 1_257_444


def test_dp1_fp32_file_has_no_main_param_copy():
    """fp32 params are their own main params: the file is the buffer (no padding without the distributed
    optimizer) and Adam's m, v and step for each of the 14 parameters."""
    cfg = parse_args(TINY + ["--global-batch-size", "2"], world_size=1)
    got = checkpoint_bytes(cfg, 0, 0, 0)
    assert (got.param_buffers, got.main_params, got.adam_m, got.adam_v) == (PARAMS * 4, 0, PARAMS * 4, PARAMS * 4)
    assert got.adam_step == TENSORS * 4 and got.tensors == 1 + 3 * TENSORS + 1
    assert got.total == 3 * PARAMS * 4 + TENSORS * 4 + 5056 == 1_882_872


# --- rows (synthetic evidence: tests the plumbing and the verdicts, not a measurement) ------------------------------

def _evidence(saves: dict[int, list[dict]], load: dict | None = None) -> RunEvidence:
    """A DP2 run's evidence holding only checkpoint events (synthetic)."""
    ranks = {rank: RankEvidence(rank=rank, coords={"tp": 0, "cp": 0, "dp": rank, "pp": 0},
                                checkpoints=typed("checkpoint", ([load] if load else []) + events))
             for rank, events in saves.items()}
    return RunEvidence(run_dir=Path("run"), manifest={"world_size": 2}, config=parse_args(DP2_DISTOPT_BF16,
                                                                                          world_size=2),
                       ranks=ranks, traces=[])


def _save(iteration: int, size: int, seconds: float = 0.01, background: float | None = None) -> dict:
    """A save event; `background` seconds make it an --async-save."""
    return {"kind": "checkpoint", "action": "save", "iteration": iteration, "bytes": size, "blocking_seconds": seconds,
            "background_seconds": background or 0.0, "async_save": background is not None,
            "write_seconds": (background or seconds) / 2, "loaded_iteration": None,
            "path": f"ck/iter_{iteration:07d}/rank_0.pt"}


def _rows(ev: RunEvidence, metric: str) -> list:
    return [r for r in checkpoint_rows(ev) if r.metric == metric]


def test_bytes_within_the_container_overhead_are_ok_and_a_missing_adam_moment_is_off():
    predicted = checkpoint_bytes(parse_args(DP2_DISTOPT_BF16, world_size=2), 0, 0, 0).total
    ok = _rows(_evidence({0: [_save(2, predicted + 13_009)]}), "checkpoint.bytes_per_rank")
    assert [(r.predicted, r.measured, r.verdict, r.step) for r in ok] == [(predicted, predicted + 13_009, "ok", 2)]
    without_v = predicted - 78_272 * 4 + 13_009
    off = _rows(_evidence({0: [_save(2, without_v)]}), "checkpoint.bytes_per_rank")
    assert [r.verdict for r in off] == ["off"]


def test_the_last_save_is_judged_and_seconds_are_measured_only():
    predicted = checkpoint_bytes(parse_args(DP2_DISTOPT_BF16, world_size=2), 0, 0, 1).total
    ev = _evidence({1: [_save(2, 1, seconds=0.5), _save(4, predicted + 10_000, seconds=0.2)]})
    (size,) = _rows(ev, "checkpoint.bytes_per_rank")
    assert (size.rank, size.step, size.verdict) == (1, 4, "ok")
    (seconds,) = _rows(ev, "checkpoint.save_blocking_seconds")
    assert (seconds.measured, seconds.step, seconds.predicted, seconds.verdict) == (0.5, 2, None, "n/a")
    assert "slowest of 2" in seconds.explanation and "no prediction" in seconds.explanation
    (background,) = _rows(ev, "checkpoint.save_background_seconds")
    assert (background.measured, background.verdict) == (0.0, "n/a")
    assert "without --async-save the whole save blocks" in background.explanation


def test_an_async_save_shows_its_blocking_and_background_parts_apart():
    ev = _evidence({0: [_save(2, 1, seconds=0.01, background=0.3), _save(4, 1, seconds=0.02, background=0.1)],
                    1: [_save(2, 1, seconds=0.03, background=0.2)]})
    blocking = _rows(ev, "checkpoint.save_blocking_seconds")
    background = _rows(ev, "checkpoint.save_background_seconds")
    assert [(r.rank, r.step, r.measured) for r in blocking] == [(0, 4, 0.02), (1, 2, 0.03)]
    assert [(r.rank, r.step, r.measured) for r in background] == [(0, 2, 0.3), (1, 2, 0.2)]
    assert "copy of the state into host memory" in blocking[0].explanation
    assert "the wait for every rank's file" in background[0].explanation
    assert "the wait for every rank's file" not in background[1].explanation


def test_the_blocking_row_says_what_the_loop_waited_for():
    """An --async-save whose blocking part was mostly the previous save's write (saves closer together than a
    write takes: the llama3.2-1b case on the H200, BENCHMARKS.md): the row names the parts the event carries."""
    save = _save(6, 1, seconds=11.6, background=16.6) | {"waited_for_previous_seconds": 10.9,
                                                         "host_alloc_seconds": 0.0, "host_copy_seconds": 0.6}
    (blocking,) = _rows(_evidence({0: [save]}), "checkpoint.save_blocking_seconds")
    assert "waiting for the previous save's background part 10.9 s" in blocking.explanation
    assert "the device-to-host copy 0.6 s" in blocking.explanation and "pinning" not in blocking.explanation


def test_events_from_before_async_save_still_read():
    old = {k: v for k, v in _save(2, 1, seconds=0.4).items()
           if k not in ("blocking_seconds", "background_seconds", "async_save")} | {"seconds": 0.4}
    (seconds,) = _rows(_evidence({0: [old]}), "checkpoint.save_blocking_seconds")
    assert seconds.measured == 0.4


def test_a_resumed_run_says_where_it_resumed_and_which_run_saved_it():
    load = {"kind": "checkpoint", "action": "load", "iteration": 3, "finetune": False, "seconds": 0.1,
            "path": "ck/iter_0000003/rank_00000.pt", "saved_by_run_dir": "/runs/first"}
    (row,) = _rows(_evidence({0: [], 1: []}, load), "checkpoint.resumed_from_iteration")
    assert (row.scope, row.measured, row.verdict) == ("run", 3, "identity")
    assert resumed([row.to_dict()]) == (" Resumed from the checkpoint of iteration 3: this run loaded ck/iter_0000003 "
                                        "(saved by run /runs/first) at start and continued after it.")
    del load["saved_by_run_dir"]  # a checkpoint saved before the run directory was recorded
    (row,) = _rows(_evidence({0: [], 1: []}, load), "checkpoint.resumed_from_iteration")
    assert "saved by a run whose directory it does not record" in row.explanation
    assert not _rows(_evidence({0: [], 1: []}), "checkpoint.resumed_from_iteration")
    assert resumed([]) == ""


# --- a real gloo run -----------------------------------------------------------------------------------------------

def _train(run_dir: Path, ckpt: Path, *extra: str) -> None:
    argv = [sys.executable, "-m", "cli.main", "train", "--nproc-per-node", "2", *DP2_DISTOPT_BF16,
            "--save", str(ckpt), "--save-interval", "2", "--run-dir", str(run_dir), *extra]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def _corrupt_bytes(run_dir: Path, rank: int, factor: float) -> None:
    events = run_dir / "ranks" / f"rank{rank}" / "events.jsonl"
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    for record in lines:
        if record["kind"] == "checkpoint" and record["action"] == "save":
            record["bytes"] = int(record["bytes"] * factor)
    events.write_text("".join(json.dumps(record) + "\n" for record in lines))


@pytest.mark.slow
def test_gloo_run_with_save_and_resume_reconciles(tmp_path):
    """A DP2 run saves at iterations 2 and 4 with --async-save; each rank's file on disk is its predicted tensors
    plus the container (the host copy writes the same tensors), and each rank's save has a blocking and a
    background part. A run resumed from it says so, and names the run that saved the checkpoint. A measurement
    halved on disk's behalf (corrupted events) is off."""
    first, second, ckpt = tmp_path / "first", tmp_path / "second", tmp_path / "ckpt"
    _train(first, ckpt, "--train-iters", "4", "--async-save")
    result = reconcile(first)
    sizes = [r for r in result.rows if r.metric == "checkpoint.bytes_per_rank"]
    assert [(r.rank, r.step, r.verdict) for r in sizes] == [(0, 4, "ok"), (1, 4, "ok")]
    for r in sizes:
        assert r.measured == (ckpt / "iter_0000004" / f"rank_{r.rank:05d}.pt").stat().st_size
        assert 0 < r.measured - r.predicted <= r.abs_tolerance  # the container adds, never removes
    for metric in ("checkpoint.save_blocking_seconds", "checkpoint.save_background_seconds"):
        assert {r.rank for r in result.rows if r.metric == metric and r.measured > 0} == {0, 1}
    assert not [r for r in result.rows if r.metric == "checkpoint.resumed_from_iteration"]

    _train(second, ckpt, "--train-iters", "6", "--load", str(ckpt))
    (resumed_row,) = [r for r in reconcile(second).rows if r.metric == "checkpoint.resumed_from_iteration"]
    assert resumed_row.measured == 4 and f"(saved by run {first})" in resumed_row.explanation

    _corrupt_bytes(first, 1, 0.5)
    corrupted = [r for r in reconcile(first).rows if r.metric == "checkpoint.bytes_per_rank"]
    assert [(r.rank, r.verdict) for r in corrupted] == [(0, "ok"), (1, "off")]
