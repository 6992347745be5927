"""Pipelined GPT training equals the single-process run: same losses, same final parameters.

The tiny model (4 layers, fp32, mock data) trains 5 steps on gloo ranks with a global batch of 8 in micro-batches of
1, and is compared with the same configuration on a world of one (tests.support.parity) to 1e-5 relative.
Pipelining only reorders the micro-batches' forwards and backwards and moves activations between ranks, so
nothing may change but fp32 summation order. Every stage reports the loss (broadcast from the last stage), and the
union of the stages' parameters is the whole model.
"""
from __future__ import annotations

import time

import pytest
import torch

from tests.support.gloo import run_distributed
from tests.support.parity import assert_close_rel, flag_value, reference, train_rank

BASE = ["--model", "tiny", "--num-layers", "4", "--micro-batch-size", "1", "--global-batch-size", "8",
        "--train-iters", "5", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "2", "--mock-data"]

LAYOUTS = {
    "pp2-1f1b": (2, ["--pipeline-model-parallel-size", "2"]),
    "pp4-1f1b": (4, ["--pipeline-model-parallel-size", "4"]),
    "pp2-vpp2-interleaved": (2, ["--pipeline-model-parallel-size", "2",
                                 "--virtual-pipeline-model-parallel-size", "2"]),
    # Interleaving with per-chunk DDP callbacks: each chunk's reduce-scatter and all-gather launched by the schedule.
    "pp2-vpp2-dp2-distopt-overlap": (4, ["--pipeline-model-parallel-size", "2",
                                         "--virtual-pipeline-model-parallel-size", "2", "--use-distributed-optimizer",
                                         "--overlap-grad-reduce", "--overlap-param-gather"]),
    # The seed's layout: rank = tp + 2 dp + 4 pp, sequence parallel, ZeRO-1 with overlapped reduce and gather.
    "tp2-pp2-dp2-sp-distopt": (8, ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                                   "--sequence-parallel", "--use-distributed-optimizer", "--overlap-grad-reduce",
                                   "--overlap-param-gather"]),
}


def _timed_train_rank(rank: int, world_size: int, argv: list[str]) -> dict:
    start = time.perf_counter()
    return train_rank(rank, world_size, argv) | {"seconds": time.perf_counter() - start}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipelined_training_equals_single_process(layout):
    world, flags = LAYOUTS[layout]
    results = run_distributed(_timed_train_rank, world, BASE + flags)
    ref = reference(tuple(BASE), flag_value(flags, "--tensor-model-parallel-size"))
    assert ref["losses"][-1] < ref["losses"][0], "the reference must actually train"
    covered: set[str] = set()
    for rank, res in enumerate(results):
        assert_close_rel(res["losses"], ref["losses"], f"rank {rank} loss")
        assert_close_rel(res["grad_norms"], ref["grad_norms"], f"rank {rank} grad norm")
        for name, value in res["params"].items():  # names carry global layer numbers
            torch.testing.assert_close(value, ref["params"][name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name: f"rank {rank} {n}: {m}")
        covered |= res["params"].keys()
    assert covered == ref["params"].keys(), "the stages together hold the whole model"
    # The run itself (process start-up and imports excluded: on a loaded 2-core machine they dominate).
    seconds = max(res["seconds"] for res in results)
    assert seconds < 60, f"{layout}: 5 steps took {seconds:.0f} s"
