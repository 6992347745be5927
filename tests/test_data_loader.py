"""The background data loader (engine.data_loader, engine.data.MicroBatchIterator): the batches of the schedule
order, byte for byte as built one at a time; a restored position restarts it there; the time `next` blocks is
measured, inside a "data-wait" probe range, and reaches the step record; and (slow) a real gloo run's ledger judges
that wait ok. The datasets here are synthetic (mock data, or a corpus whose tokens say where they came from): they
test the plumbing; the gloo run measures a real loader on a real run."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch

from common.arguments import parse_args
from engine.data import (
    HostBatches,
    MicroBatchIterator,
    MockGPTDataset,
    data_wait_figures,
)
from engine.data_loader import Prefetcher
from engine.datasets.indexed_dataset import IndexedDatasetWriter
from tests.support.gloo import world_of_one
from tests.support.parity import train_and_collect
from tests.support.recording_probes import RangeLog

CPU = torch.device("cpu")


def _config(*extra: str):
    return parse_args(["--model", "tiny", "--micro-batch-size", "2", "--global-batch-size", "8", *extra],
                      world_size=2)


def _iterator(dataset, cfg, probes=None, **needs) -> MicroBatchIterator:
    needs = needs or dict(needs_tokens=True, needs_labels=True)
    return MicroBatchIterator(dataset, cfg, dp_rank=1, dp_size=2, device=CPU, probes=probes, **needs)


def _expected(dataset, cfg, position: int) -> torch.Tensor:
    """The micro-batch at `position`, built in this thread: what a synchronous loader returns."""
    return HostBatches(dataset, cfg, dp_rank=1, dp_size=2, pin=False)(position)


def test_the_background_loader_serves_the_schedule_order_byte_for_byte():
    cfg = _config()  # 2 micro-batches per iteration on each of 2 DP ranks
    dataset = MockGPTDataset(1000, 32, seed=1)
    it = _iterator(dataset, cfg)
    for position in range(9):  # across several iterations and the prefetch depth
        batch, expected = next(it), _expected(dataset, cfg, position)
        assert torch.equal(batch.tokens, expected[:, :-1]) and torch.equal(batch.labels, expected[:, 1:])
    # from first principles: position 9 is iteration 4, micro-batch 1 of DP rank 1: samples 4*8 + 4 + 2, and + 1
    assert torch.equal(_expected(dataset, cfg, 9), torch.stack([dataset[38], dataset[39]]))
    it.close()


def test_a_restored_position_restarts_the_loader_there():
    """What a checkpoint's load does (engine.checkpointing sets `position`): the batches built ahead for the old
    position are dropped and the next one is the restored position's."""
    cfg = _config()
    dataset = MockGPTDataset(1000, 32, seed=1)
    it = _iterator(dataset, cfg)
    for _ in range(5):
        next(it)
    it.position = 2
    assert it.position == 2
    assert torch.equal(next(it).tokens, _expected(dataset, cfg, 2)[:, :-1])
    assert it.position == 3
    it.position = 40
    assert torch.equal(next(it).labels, _expected(dataset, cfg, 40)[:, 1:])
    it.close()


def test_a_middle_stage_runs_no_thread_and_reports_no_wait():
    cfg = _config()
    before = threading.active_count()
    middle = _iterator(MockGPTDataset(1000, 32, seed=1), cfg, needs_tokens=False, needs_labels=False)
    batch = next(middle)
    assert batch.tokens is None and batch.labels is None and middle.position == 1
    assert threading.active_count() == before
    assert data_wait_figures([middle]) == {}


class SlowDataset:
    """Each sample takes `seconds` to build: a loader that cannot keep ahead of a loop that does no work."""

    def __init__(self, seconds: float):
        self.seconds, self.inner = seconds, MockGPTDataset(1000, 32, seed=1)

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.seconds)
        return self.inner[index]



def test_the_wait_is_measured_inside_a_data_wait_range_and_taken_per_step():
    cfg = _config()  # 2 samples per micro-batch: a batch takes 2 x 50 ms to build
    probes = RangeLog()
    it = _iterator(SlowDataset(0.05), cfg, probes)
    next(it), next(it)  # the loop asks at once: it waits for (nearly) every sample
    figures = data_wait_figures([it])
    assert 0.15 < figures["data_wait_s"] < 1.0
    assert probes.ranges == [("wait data mb0", "data-wait"), ("wait data mb1", "data-wait")]
    assert data_wait_figures([it]) == {"data_wait_s": 0.0}  # taken: the next step counts afresh
    time.sleep(0.5)  # the loop computes; the loader builds the next micro-batches meanwhile
    next(it), next(it)
    assert data_wait_figures([it])["data_wait_s"] < 0.01
    it.close()


def test_a_sample_that_fails_raises_at_the_consumer_for_that_position_only():
    def produce(position: int) -> int:
        if position == 3:
            raise IndexError("sample 3 is past the dataset's end")
        return position * 10

    prefetcher = Prefetcher(produce, start=1, depth=2)
    assert [prefetcher.get()[0] for _ in range(2)] == [10, 20]
    with pytest.raises(IndexError, match="past the dataset's end"):
        prefetcher.get()
    prefetcher.close()


def _until(condition, seconds: float = 5.0) -> bool:
    deadline = time.monotonic() + seconds
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.005)
    return condition()


def test_the_thread_refills_in_bursts_of_half_its_depth():
    """It sleeps while more than half the queue waits, so that it does not compete with the loop for the
    interpreter's lock after every batch (docs/engine.md, "Data")."""
    built: list[int] = []
    prefetcher = Prefetcher(lambda position: built.append(position) or position, start=0, depth=8)
    assert _until(lambda: len(built) == 8)
    assert [prefetcher.get()[0] for _ in range(3)] == [0, 1, 2]
    time.sleep(0.1)
    assert len(built) == 8  # 5 still wait: more than half
    assert prefetcher.get()[0] == 3  # 4 wait: the thread wakes and refills to 8 ahead
    assert _until(lambda: len(built) == 12) and built == list(range(12))
    prefetcher.close()


def test_close_stops_the_thread_even_with_a_full_queue():
    prefetcher = Prefetcher(lambda position: position, start=0, depth=2)
    time.sleep(0.05)  # the producer fills its queue and blocks
    prefetcher.close()
    assert not prefetcher._thread.is_alive()


def _corpus(prefix, documents=40, length=50):
    """Token ids below the tiny model's vocabulary of 1000, each document a different run of them."""
    writer = IndexedDatasetWriter(prefix, np.uint16)
    for d in range(documents):
        writer.add_document([(7 * d + j) % 1000 for j in range(length)])
    writer.finalize()


def test_real_data_resumes_bit_for_bit_through_the_loader(tmp_path):
    """6 steps straight == 3 steps, saved, then --load and 3 more, on --data-path: the loader restarts at the
    restored position and serves the same samples (tests/test_checkpointing.py does the same on mock data)."""
    _corpus(tmp_path / "c")
    argv = ["--model", "tiny", "--num-layers", "2", "--micro-batch-size", "1", "--global-batch-size", "2",
            "--lr", "3e-3", "--train-iters", "6", "--data-path", str(tmp_path / "c"), "--split", "100,0,0"]
    with world_of_one():
        straight = train_and_collect(parse_args(argv, world_size=1))
    save = ["--save", str(tmp_path / "ckpt"), "--save-interval", "3"]
    with world_of_one():
        first = train_and_collect(parse_args(argv + save + ["--exit-interval", "3"], world_size=1))
    with world_of_one():
        second = train_and_collect(parse_args(argv + save + ["--load", str(tmp_path / "ckpt")], world_size=1))
    assert first["losses"] == straight["losses"][:3] and second["losses"] == straight["losses"][3:]
    for name, value in straight["params"].items():
        assert torch.equal(second["params"][name], value), name


@pytest.mark.slow
@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="2 ranks on one core: the ledger sets their timings aside")
def test_a_gloo_run_on_real_data_waits_for_no_batch(tmp_path):
    """A real 2-rank run (pipeline stages: the first reads tokens, the last labels) with the loader on, 2 ranks on
    2 cores so that its timings are judged: the ledger's data-wait row is ok on both ranks."""
    from ledger.reconcile.run import reconcile

    _corpus(tmp_path / "c", documents=200, length=300)
    run = tmp_path / "run"
    argv = [sys.executable, "-m", "cli.main", "train", "--nproc-per-node", "2", "--model", "tiny",
            "--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--micro-batch-size", "1",
            "--train-iters", "6", "--data-path", str(tmp_path / "c"), "--split", "100,0,0", "--timers",
            "--run-dir", str(run)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = reconcile(run)
    rows = [r for r in result.rows if r.metric == "time.data_wait_per_step"]
    assert [r.rank for r in rows] == [0, 1]
    assert all(r.verdict == "ok" for r in rows), [(r.measured, r.abs_tolerance, r.explanation) for r in rows]
