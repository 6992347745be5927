"""Expert parallelism trains exactly the single-process MoE model: EP2 (world 2), EP2 x expert-DP2 (world 4, with the
distributed optimizer, overlapped grad reduction and full recompute, whose re-run repeats the all-to-alls) and
EP2 x PP2 (world 4: a stage's all-to-alls interleaved with the pipeline's exchanges), EP2 with grouped expert
GEMMs (--moe-grouped-gemm) and EP2 x expert-DP2 with each expert's weight gradient computed once a step
(--moe-delay-expert-wgrad, full recompute) against one process (SequentialMLP), to 1e-5 relative in fp32 on gloo.

One run per layout serves every assertion: losses, grad norms (clipping active), parameters (each expert lives on
one EP rank, so the union of the ranks' parameters is the single-process model), the routing counts of the step
records (the ranks route disjoint micro-batches, so their counts add up to the single process's; their
load-balancing losses average to it), and the all-to-all ranges' bytes (each rank's dispatch sends one row of h
fp32 per kept assignment; the combine returns the rows the dispatch received; each backward is its forward the
other way).
"""
import functools

import pytest

from common.arguments import parse_args
from probes.probe_set import NullProbeSet
from tests.support.gloo import run_distributed, world_of_one
from tests.support.parity import (
    assert_close_rel,
    assert_rank_matches,
    flag_value,
    single_process_config,
    train_and_collect,
)

CLIP = 0.05
HIDDEN = 64  # the tiny model's
BASE = ["--model", "tiny", "--num-layers", "2", "--micro-batch-size", "1", "--global-batch-size", "8",
        "--train-iters", "4", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "2",
        "--clip-grad", str(CLIP), "--mock-data", "--num-experts", "4", "--moe-router-topk", "2",
        "--moe-aux-loss-coeff", "0.01", "--moe-expert-capacity-factor", "1.0"]
RECOMPUTE = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
LAYOUTS = {
    "ep2": (2, ["--expert-model-parallel-size", "2"]),
    "ep2-expert-dp2": (4, ["--expert-model-parallel-size", "2", "--use-distributed-optimizer", "--overlap-grad-reduce",
                           *RECOMPUTE]),
    "ep2-pp2": (4, ["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]),
    # grouped GEMMs at EP 2 (the counts read on the host for the all-to-alls) against SequentialMLP on one process
    "ep2-grouped-gemm": (2, ["--expert-model-parallel-size", "2", "--moe-grouped-gemm"]),
    # each expert's weight gradient once a step: the flush before the expert-DP reduction, under full recompute
    "ep2-expert-dp2-delayed-wgrad": (4, ["--expert-model-parallel-size", "2", "--use-distributed-optimizer",
                                         *RECOMPUTE, "--moe-delay-expert-wgrad"]),
}


class Recorder(NullProbeSet):
    """Probes that keep the step figures and the ep-comm ranges (name and attributes)."""

    def __init__(self):
        self.steps, self.ranges = [], []

    def step_end(self, iteration, **figures):
        self.steps.append(figures)

    def range(self, name, category, **attrs):
        if category == "ep-comm":
            self.ranges.append((name, attrs))
        return super().range(name, category, **attrs)


def moe_rank(rank: int, world_size: int, argv: list[str]) -> dict:
    probes = Recorder()
    result = train_and_collect(parse_args(argv, world_size=world_size), probes=probes)
    return {**result, "steps": probes.steps, "ranges": probes.ranges}


@functools.cache
def reference(recompute: bool) -> dict:
    probes = Recorder()
    with world_of_one():
        result = train_and_collect(single_process_config(parse_args(BASE + (RECOMPUTE if recompute else []),
                                                                    world_size=1)), probes=probes)
    assert not probes.ranges, "EP 1 takes no collective"
    return {**result, "steps": probes.steps}


def summed_counts(steps_by_rank: list[list[dict]], key: str) -> list[dict[str, list[int]]]:
    """Per step, each layer's counts summed over the ranks that hold it."""
    totals = []
    for i in range(len(steps_by_rank[0])):
        total: dict[str, list[int]] = {}
        for steps in steps_by_rank:
            for layer, counts in steps[i][key].items():
                total[layer] = [a + b for a, b in zip(total.get(layer, [0] * len(counts)), counts)]
        totals.append(total)
    return totals


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_expert_parallel_run_equals_single_process(layout):
    world, flags = LAYOUTS[layout]
    results = run_distributed(moe_rank, world, BASE + flags)
    reruns = 2 if RECOMPUTE[0] in flags else 1  # full recompute's re-run repeats each forward's all-to-alls
    ref = reference(reruns == 2)
    assert min(ref["grad_norms"]) > CLIP, "clipping must be active on every step"
    assert ref["losses"][-1] < ref["losses"][0], "the reference must actually train"
    union = {}
    for rank, res in enumerate(results):
        assert_rank_matches(res, ref, rank)
        union.update(res["params"])
    assert union.keys() == ref["params"].keys()
    experts_of = [{n.split(".experts.")[1].split(".")[0] for n in res["params"] if ".experts." in n}
                  for res in results]
    # EP is the fastest axis after tp (1) in the expert grid: EP rank = global rank % 2
    assert all(experts == ({"0", "1"} if rank % 2 == 0 else {"2", "3"}) for rank, experts in enumerate(experts_of))

    steps_by_rank = [res["steps"] for res in results]
    for key in ("moe_tokens_per_expert", "moe_dropped_tokens"):
        assert summed_counts(steps_by_rank, key) == [s[key] for s in ref["steps"]], key
    assert sum(sum(d) for d in ref["steps"][0]["moe_dropped_tokens"].values()) > 0, "capacity must drop some"
    # each rank's load-balancing loss is its layers' mean over its micro-batches: the mean over the DP ranks of a
    # stage, summed over the stages, is the single process's
    dp = world // flag_value(flags, "--pipeline-model-parallel-size")
    assert_close_rel([sum(steps[i]["moe_aux_loss"] for steps in steps_by_rank) / dp for i in range(len(ref["steps"]))],
                     [s["moe_aux_loss"] for s in ref["steps"]], "moe_aux_loss")

    def ep_bytes(res: dict, kind: str, phase: str = "forward") -> int:
        return sum(a["bytes"] for n, a in res["ranges"]
                   if n.startswith(f"ep all-to-all {kind}") and a["phase"] == phase)

    # a rank's combine sends back what it received in the dispatch: over the ranks the two volumes are equal
    assert sum(ep_bytes(r, "dispatch") for r in results) == sum(ep_bytes(r, "combine") for r in results)
    for res in results:
        # the backward of each exchange is the same exchange the other way: a rank sends in the backward of the
        # combine what it sent in the forward of the dispatch (re-runs aside)
        assert ep_bytes(res, "combine", "backward") * reruns == ep_bytes(res, "dispatch")
        last_step = res["steps"][-1]
        forward = [(n, a) for n, a in res["ranges"] if a["phase"] == "forward"]
        dispatch = [a for n, a in forward if n.startswith("ep all-to-all dispatch layer")]
        combine = [a for n, a in forward if n.startswith("ep all-to-all combine layer")]
        counts = [a for n, a in forward if n.startswith("ep all-to-all counts layer")]
        pp = flag_value(flags, "--pipeline-model-parallel-size")
        # steps x this rank's layers x its micro-batches x reruns
        calls = len(res["steps"]) * (2 // pp) * (8 // (world // pp)) * reruns
        assert len(dispatch) == len(combine) == len(counts) == calls
        assert all(a["bytes"] == 4 * 8 and a["remote_bytes"] == 2 * 8 for a in counts)  # E int64, half remote
        assert all(a["bytes"] % (HIDDEN * 4) == 0 for a in dispatch + combine)
        # the step's dispatched rows: its kept assignments (a re-run dispatches the same again)
        kept = sum(t - d for layer, tokens in last_step["moe_tokens_per_expert"].items()
                   for t, d in zip(tokens, last_step["moe_dropped_tokens"][layer]))
        per_step = len(dispatch) // len(res["steps"])
        last = dispatch[-per_step:]
        assert sum(a["bytes"] for a in last) == kept * HIDDEN * 4 * reruns
        assert all(a["remote_bytes"] <= a["bytes"] for a in last) and sum(a["remote_bytes"] for a in last) > 0
        backward = [a for n, a in res["ranges"] if a["phase"] == "backward"]
        assert len(backward) == 2 * len(dispatch) // reruns
        assert {str(a["layer"]) for a in dispatch} == set(last_step["moe_tokens_per_expert"])
