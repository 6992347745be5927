"""Pipelined GPT training equals the single-process run: same losses, same final parameters.

The tiny model (4 layers, fp32, mock data) trains 5 steps on gloo ranks with a global batch of 8 in micro-batches of
1, and is compared with the same configuration on a world of one (tests.support.parity) to 1e-5 relative.
Pipelining only reorders the micro-batches' forwards and backwards and moves activations between ranks, so
nothing may change but fp32 summation order. Every stage reports the loss (broadcast from the last stage), and the
union of the stages' parameters is the whole model.

Tied embeddings (Megatron's default) split over stages: the last stage's copy of the embedding starts equal to the
first stage's and both must apply the single-process weight's update (the two copies' grads summed over the
embedding group), so each copy is compared with the reference's one weight. The untied layouts pass
--untie-embeddings-and-output-weights, to the reference too.
"""
from __future__ import annotations

import time

import pytest
import torch

from tests.support.gloo import run_distributed
from tests.support.parity import (
    TIED_EMBEDDING,
    assert_close_rel,
    flag_value,
    reference,
    train_rank,
)

BASE = ["--model", "tiny", "--num-layers", "4", "--micro-batch-size", "1", "--global-batch-size", "8",
        "--train-iters", "5", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "2", "--mock-data"]

UNTIE = ["--untie-embeddings-and-output-weights"]
PP2 = ["--pipeline-model-parallel-size", "2"]
VPP2 = ["--virtual-pipeline-model-parallel-size", "2"]
UNEVEN_ENDS = ["--decoder-first-pipeline-num-layers", "1", "--decoder-last-pipeline-num-layers", "1"]
DISTOPT_OVERLAP = ["--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"]

# name: (world size, model flags (the reference's too), parallel flags)
LAYOUTS = {
    "pp2-1f1b": (2, UNTIE, PP2),
    "pp4-1f1b": (4, UNTIE, ["--pipeline-model-parallel-size", "4"]),
    "pp2-vpp2-interleaved": (2, UNTIE, PP2 + VPP2),
    # Interleaving with per-chunk DDP callbacks: each chunk's reduce-scatter and all-gather launched by the schedule.
    "pp2-vpp2-dp2-distopt-overlap": (4, UNTIE, PP2 + VPP2 + DISTOPT_OVERLAP),
    # The reference run's layout: rank = tp + 2 dp + 4 pp, sequence parallel, ZeRO-1 with overlapped reduce and gather.
    "tp2-pp2-dp2-sp-distopt": (8, UNTIE, ["--tensor-model-parallel-size", "2", *PP2, "--sequence-parallel",
                                          *DISTOPT_OVERLAP]),
    # Tied: the copy on the last stage, its grad all-reduced with the first stage's after the DP reduction.
    "pp2-tied": (2, [], PP2),
    # ...the original on chunk 0 of stage 0, the copy on chunk 1 of stage 1, each in a bucket of its own whose
    # shards the same DP rank owns on both stages.
    "pp2-vpp2-dp2-distopt-tied": (4, [], PP2 + VPP2 + DISTOPT_OVERLAP),
    # ...each TP rank's vocab shard paired with the same TP rank's on the other stage.
    "tp2-pp2-sp-tied": (4, [], ["--tensor-model-parallel-size", "2", *PP2, "--sequence-parallel"]),
    # Uneven stages (Megatron-LM's flags): 4 layers as 1, 2, 1; tied, so the copy sits on a stage of one layer.
    "pp3-uneven-tied": (3, [], ["--pipeline-model-parallel-size", "3", *UNEVEN_ENDS]),
    # ...and interleaved: 8 layers as 2, 4, 2, every stage's in two chunks (1, 2, 1 layers a chunk); 6 micro-batches,
    # a multiple of the 3 stages.
    "pp3-vpp2-uneven-interleaved": (3, UNTIE + ["--num-layers", "8", "--global-batch-size", "6"],
                                    ["--pipeline-model-parallel-size", "3", *VPP2,
                                     "--decoder-first-pipeline-num-layers", "2",
                                     "--decoder-last-pipeline-num-layers", "2"]),
    # The embedding and the loss counted as layers (Llama 3's split): 2 layers over 2 x 2 virtual stages of one
    # slot each, the first the embedding alone, the last the loss alone.
    "pp2-vpp2-ends-as-layers": (2, UNTIE + ["--num-layers", "2"],
                                [*PP2, *VPP2, "--account-for-embedding-in-pipeline-split",
                                 "--account-for-loss-in-pipeline-split"]),
    # Spelled out (Megatron's --pipeline-model-parallel-layout): 4 layers as 1 | 2 | 1 | the loss alone, V 2 from it.
    "pp2-layout": (2, UNTIE + ["--num-layers", "4"], [*PP2, "--pipeline-model-parallel-layout", "Et|tt|t|L"]),
}

# Uneven stages' layers, from Megatron's rule (first and last stage their own count, the rest split evenly; chunk c
# of stage r starts at c L/v plus the chunk-c layers of the stages before r).
STAGE_LAYERS = {"pp3-uneven-tied": {0: [0], 1: [1, 2], 2: [3]},
                "pp3-vpp2-uneven-interleaved": {0: [0, 4], 1: [1, 2, 5, 6], 2: [3, 7]},
                "pp2-vpp2-ends-as-layers": {0: [1], 1: [0]},
                "pp2-layout": {0: [0, 3], 1: [1, 2]}}


def _timed_train_rank(rank: int, world_size: int, argv: list[str]) -> dict:
    start = time.perf_counter()
    return train_rank(rank, world_size, argv) | {"seconds": time.perf_counter() - start}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_pipelined_training_equals_single_process(layout):
    world, model_flags, flags = LAYOUTS[layout]
    results = run_distributed(_timed_train_rank, world, BASE + model_flags + flags)
    ref = reference(tuple(BASE + model_flags), flag_value(flags, "--tensor-model-parallel-size"))
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
    if layout in STAGE_LAYERS:
        held = {res["coordinates"]["pp"]: sorted({int(n.split(".")[2]) for n in res["params"]
                                                  if n.startswith("decoder.layers.")}) for res in results}
        assert held == STAGE_LAYERS[layout]
    if UNTIE[0] not in model_flags:  # tied: both ends of every pipeline held a copy, each compared with the one weight
        ends = {0, flag_value(flags, "--pipeline-model-parallel-size") - 1}
        assert all(TIED_EMBEDDING in res["params"] for res in results if res["coordinates"]["pp"] in ends)
    # The run itself (process start-up and imports excluded: on a loaded 2-core machine they dominate).
    seconds = max(res["seconds"] for res in results)
    assert seconds < 60, f"{layout}: 5 steps took {seconds:.0f} s"
