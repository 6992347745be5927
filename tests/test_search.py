"""The layout search core (ledger/models/simulate/layouts.py, search.py, bound.py) and the peak memory it filters with
(ledger/models/formulas/peak_memory.py).

The enumeration rules are derived by hand for a small case. The search itself is tested on a dummy score: plumbing
(ranking, pruning, dropping, the loser's reason), not a claim about which layout is fastest; that is the time model's,
checked against real runs elsewhere.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from common.arguments import parse_args
from common.config import RecomputeConfig, RunConfig
from common.errors import ConfigError
from ledger.models.formulas.peak_memory import peak_bytes_per_stage, stage_peaks
from ledger.models.formulas.static_memory import (
    largest_dp_rank,
    static_bytes,
    static_bytes_max,
)
from ledger.models.plan import build_plan
from ledger.models.simulate.hardware import load_hardware
from ledger.models.simulate.layouts import describe, enumerate_layouts, label, with_layout
from ledger.models.simulate.pricing import Pricing
from ledger.models.simulate.search import loses_because, memory_fit, search
from ledger.models.simulate.simulation import MAX_MICROBATCHES
from ledger.present.search_reason import reason_text

# 4 layers, 8 heads in 4 query groups; the global batch 8.
SMALL = ("--num-layers 4 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 8 --num-query-groups 4 "
         "--vocab-size 1000 --seq-length 32 --global-batch-size 8 --bf16 --overlap-grad-reduce "
         "--overlap-param-gather --use-distributed-optimizer")


def base(flags: str = SMALL) -> RunConfig:
    return parse_args(flags.split())


def keys(layouts) -> set[tuple[int, int, int]]:
    return {(c.parallel.tensor_model_parallel_size, c.parallel.pipeline_model_parallel_size,
             c.parallel.data_parallel_size) for c in layouts}


# ---- enumeration ---------------------------------------------------------------------------------------------------

def test_the_tp_pp_dp_of_8_gpus_for_4_layers_and_4_query_groups():
    """tp divides 8 GPUs and the 4 query groups (so not 8): 1, 2, 4; pp divides 8 / tp and the 4 layers: tp 1 and
    2 take 1, 2, 4 (8 does not divide 4 layers); tp 4 takes 1, 2; dp is the rest."""
    expected = {(1, 1, 8), (1, 2, 4), (1, 4, 2), (2, 1, 4), (2, 2, 2), (2, 4, 1), (4, 1, 2), (4, 2, 1)}
    assert keys(enumerate_layouts(base(), 8, gpus_per_node=8)) == expected
    # TP stays inside a node
    assert keys(enumerate_layouts(base(), 8, gpus_per_node=2)) == {k for k in expected if k[0] <= 2}


def test_every_choice_of_one_tp_pp_is_enumerated_once():
    """tp 2, pp 2, dp 2: each DP rank takes 8 / 2 = 4 sequences, so mbs 1, 2, 4; vpp None, or 2 (4 layers / pp 2
    = 2 a stage) whose micro-batch count 4 / mbs must be a multiple of pp 2: mbs 1 and 2. That is 3 + 2 = 5, times
    3 recompute modes, 2 optimizer settings, SP on and off: 60. Counting the embedding and the loss as layers gives
    6 slots, 3 a stage: without vpp that is the even split again (E + 2 layers, 2 layers + L: not listed twice);
    with vpp 3 (chunks of 0-1 layers) the micro-batch sizes 1 and 2: 2 x 12 = 24 more."""
    chosen = [c for c in enumerate_layouts(base(), 8, gpus_per_node=8) if keys([c]) == {(2, 2, 2)}]
    assert len(chosen) == 84
    assert len({label(c) for c in chosen}) == 84
    splits = {ends: {(c.parallel.virtual_pipeline_model_parallel_size, c.train.micro_batch_size) for c in chosen
                     if c.parallel.account_for_embedding_in_pipeline_split == ends} for ends in (False, True)}
    assert splits == {False: {(None, 1), (None, 2), (None, 4), (2, 1), (2, 2)}, True: {(3, 1), (3, 2)}}
    assert {c.recompute.recompute_granularity for c in chosen} == {None, "selective", "full"}


def test_layouts_keep_the_base_and_only_valid_flag_combinations():
    rejected: Counter[str] = Counter()
    layouts = list(enumerate_layouts(base(), 8, gpus_per_node=8, rejected=rejected))
    assert all(c.parallel.world_size == 8 and c.train.global_batch_size == 8 and c.model.seq_length == 32
               for c in layouts)
    assert not any(c.parallel.sequence_parallel and c.parallel.tensor_model_parallel_size == 1 for c in layouts)
    assert not any(c.train.overlap_param_gather and not c.train.use_distributed_optimizer for c in layouts)
    assert {c.train.overlap_param_gather for c in layouts if c.train.use_distributed_optimizer} == {True}
    assert not any(c.parallel.virtual_pipeline_model_parallel_size and c.parallel.pipeline_model_parallel_size == 1
                   for c in layouts)
    # candidates common.config.validate refuses are counted by the flag it names, never yielded
    assert rejected["interleaved"] > 0


def test_one_data_parallel_rank_takes_no_distributed_optimizer_choice():
    """Over one DP rank the distributed optimizer's shard is the whole state: tp 2 pp 4 and tp 4 pp 2 (dp 1 of 8
    GPUs) come once each way of the other knobs, without it; tp 2 pp 2 (dp 2) still both ways."""
    layouts = list(enumerate_layouts(base(), 8, gpus_per_node=8))
    dp1 = [c for c in layouts if c.parallel.data_parallel_size == 1]
    assert dp1 and not any(c.train.use_distributed_optimizer for c in dp1)
    assert {c.train.use_distributed_optimizer for c in layouts if keys([c]) == {(2, 2, 2)}} == {False, True}


def test_options_narrow_the_enumeration():
    only = list(enumerate_layouts(base(), 8, gpus_per_node=8, recompute=(RecomputeConfig(),),
                                  distributed_optimizer=(True,), sequence_parallel=(True,)))
    assert {describe(c)["recompute"] for c in only} == {"none"}
    assert all(c.train.use_distributed_optimizer for c in only)
    assert all(c.parallel.sequence_parallel for c in only if c.parallel.tensor_model_parallel_size > 1)


# ---- peak memory ---------------------------------------------------------------------------------------------------

REFERENCE = ("--model llama3.2-1b --world-size 8 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
        "--sequence-parallel --use-distributed-optimizer --overlap-grad-reduce --seq-length 8192 "
        "--max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 16 --bf16")


def test_plan_reports_the_shared_peak_function():
    cfg = base(REFERENCE)
    memory = build_plan(cfg)["memory"]
    peaks = stage_peaks(cfg)
    assert memory["peak_bytes_per_stage"] == peak_bytes_per_stage(cfg) == [p.total for p in peaks]
    assert memory["peak_bytes_per_stage"] == [p.static.total + p.activations for p in peaks]
    assert memory["static_bytes_per_stage"] == [p.static.to_dict() for p in peaks]


@pytest.mark.parametrize("world, dp_flags", [(24, "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"),
                                             (7, "")], ids=["dp6", "dp7"])
def test_the_largest_dp_rank_is_the_one_the_definition_finds(world, dp_flags):
    """The fast path (each DP rank's shard counted in one walk) against the definition: static_bytes of every DP
    rank, the first of the largest. Odd DP sizes make the shards' real elements differ between ranks."""
    flags = (f"--model tiny --world-size {world} {dp_flags} --use-distributed-optimizer --overlap-grad-reduce "
             f"--ddp-bucket-size 3000 --bf16 --global-batch-size {world * 4}")
    cfg = base(flags)
    p = cfg.parallel
    for pp in range(p.pipeline_model_parallel_size):
        every = [static_bytes(cfg, 0, pp, d) for d in range(p.data_parallel_size)]
        assert len({s.total for s in every}) > 1  # the case exercises unequal shards
        first_largest = max(range(len(every)), key=lambda d: (every[d].total, -d))
        assert largest_dp_rank(cfg, pp) == (first_largest, every[first_largest])
    whole = [(static_bytes(cfg, 0, pp, d).total, (0, pp, d)) for pp in range(p.pipeline_model_parallel_size)
             for d in range(p.data_parallel_size)]
    assert static_bytes_max(cfg) == max(whole, key=lambda item: item[0])


def test_a_layouts_flags_replace_the_bases_and_parse_back_to_it():
    """Every enumerated layout, written as flags over the base's own (which hold layout flags too), parses back to
    the same layout: the command `search` prints for its first layout is that layout."""
    argv = SMALL.split() + ["--micro-batch-size=2", "--sequence-parallel", "--account-for-loss-in-pipeline-split",
                            "--decoder-first-pipeline-num-layers", "1"]
    for cfg in enumerate_layouts(base(), 8, gpus_per_node=8):
        flags = with_layout(argv, cfg)
        again = parse_args(flags, world_size=8)
        assert describe(again) == describe(cfg), flags
        assert again.train.overlap_param_gather == cfg.train.overlap_param_gather


def test_a_label_names_every_choice():
    cfg = next(c for c in enumerate_layouts(base(), 8, gpus_per_node=8) if c.parallel.sequence_parallel
               and c.recompute.recompute_granularity == "selective" and c.train.use_distributed_optimizer
               and c.parallel.virtual_pipeline_model_parallel_size)
    d = describe(cfg)
    assert label(cfg) == (f"tp{d['tp']} pp{d['pp']} vpp{d['vpp']} dp{d['dp']} mbs{d['mbs']}, SP, recompute selective, "
                          "distributed optimizer")


def test_memory_fit_names_the_stage_that_does_not_fit():
    cfg = base(REFERENCE)
    peaks = peak_bytes_per_stage(cfg)
    assert memory_fit(max(peaks))(cfg) is True
    assert memory_fit(max(peaks), outside_bytes=1)(cfg) == (
        f"out of memory: stage {peaks.index(max(peaks))} needs {(max(peaks) + 1) / 2**30:,.1f} GiB of "
        f"{max(peaks) / 2**30:,.1f} GiB")  # GiB, as every other size the search prints


# ---- the search, on a dummy score (plumbing) -----------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Dummy:
    """A stand-in for the time model's StepPrediction: a step of named terms, tokens/s from their sum."""
    terms: dict[str, float]
    tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / sum(self.terms.values())


def dummy_score(cfg: RunConfig) -> Dummy:
    """Compute shrinks with tp (TP comm grows with it), the bubble with micro-batches, recompute costs a third:
    arbitrary, but every term moves with a different knob."""
    d = describe(cfg)
    m = cfg.num_microbatches
    return Dummy({"forward/backward compute": 8 / d["tp"] * (4 / 3 if d["recompute"] == "full" else 1.0),
                  "TP comm": 0.3 * (d["tp"] - 1), "pipeline bubble": (d["pp"] - 1) / (d["vpp"] * m),
                  "optimizer": 0.1 if d["distributed_optimizer"] else 0.4}, 8 * 32)


def test_search_ranks_by_tokens_per_s_and_says_why_each_loses():
    result = search(base(), 8, fits=lambda c: True, score=dummy_score, top=4, gpus_per_node=8)
    everything = sorted((dummy_score(c).tokens_per_s for c in enumerate_layouts(base(), 8, gpus_per_node=8)),
                        reverse=True)
    assert [r.prediction.tokens_per_s for r in result.ranked] == everything[:4]
    assert result.ranked[0].reason is None
    assert result.scored == result.fitting == result.enumerated and result.skipped_by_bound == 0
    first = result.ranked[0]
    for r in result.ranked[1:]:
        assert r.reason == loses_because(r.layout, r.prediction, first.layout, first.prediction)


def test_the_reason_names_the_term_that_grows_most():
    a = base(SMALL + " --world-size 8 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2")
    b = dataclasses.replace(a, parallel=dataclasses.replace(a.parallel, pipeline_model_parallel_size=4,
                                                            tensor_model_parallel_size=1))
    fast = Dummy({"compute": 1.0, "pipeline bubble": 0.1}, 1000)
    slow = Dummy({"compute": 0.9, "pipeline bubble": 0.31}, 1000)
    # compute shrinks by 0.1 s, the bubble grows by 0.21 s: 1000 / 1.21 vs 1000 / 1.1 tokens/s; dp is 2 in both
    assert reason_text(loses_because(b, slow, a, fast)) == ("pipeline bubble +210 ms (tp 1 vs 2, pp 4 vs 2): "
                                                            "826 vs 909 tokens/s (-9.1%)")


def test_the_reason_gives_a_small_term_in_a_unit_that_shows_it():
    """A toy model's terms differ by fractions of a millisecond: the growth is written in µs then, never as
    "+0.000 s", which reads as if nothing grew."""
    a = base(SMALL + " --world-size 8 --tensor-model-parallel-size 2")
    b = dataclasses.replace(a, parallel=dataclasses.replace(a.parallel, tensor_model_parallel_size=1))
    reason = loses_because(b, Dummy({"compute": 0.0104}, 1000), a, Dummy({"compute": 0.01}, 1000))
    assert reason.term == "compute" and reason.growth_s == pytest.approx(4e-4)
    assert reason_text(reason).startswith("compute +400 µs (tp 1 vs 2, dp 8 vs 4): ")


def test_the_reason_names_a_choice_only_one_of_the_two_layouts_makes():
    """Context parallelism and the ends counted as layers, chosen by either side (in both directions): each is named
    with its value on both sides (a layout without them once lacked their keys, and the search stopped there); CP 2
    leaves DP 1 of the 8 GPUs."""
    a = base(SMALL + " --world-size 8 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2")
    b = dataclasses.replace(a, parallel=dataclasses.replace(a.parallel, context_parallel_size=2,
                                                            account_for_embedding_in_pipeline_split=True))
    same = Dummy({"compute": 1.0}, 1000)
    assert reason_text(loses_because(b, same, a, same)) == (
        "no term larger (cp 2 vs 1, ends_as_layers on vs off, dp 1 vs 2): 1,000 vs 1,000 tokens/s (+0.0%)")
    assert reason_text(loses_because(a, same, b, same)).startswith(
        "no term larger (cp 1 vs 2, ends_as_layers off vs on, dp 2 vs 1)")


def test_layouts_that_do_not_fit_are_counted_by_kind_and_never_scored():
    scored: list[RunConfig] = []

    def fits(cfg: RunConfig) -> bool | str:
        if cfg.parallel.tensor_model_parallel_size == 1:
            return f"out of memory: stage 0 needs {cfg.train.micro_batch_size} GB"
        return cfg.recompute.recompute_granularity is not None  # False: "does not fit"

    def score(cfg: RunConfig) -> Dummy:
        scored.append(cfg)
        return dummy_score(cfg)

    result = search(base(), 8, fits=fits, score=score, top=3, gpus_per_node=8)
    layouts = list(enumerate_layouts(base(), 8, gpus_per_node=8))
    tp1 = sum(c.parallel.tensor_model_parallel_size == 1 for c in layouts)
    plain = sum(c.parallel.tensor_model_parallel_size > 1 and c.recompute.recompute_granularity is None
                for c in layouts)
    assert result.dropped == {"out of memory": tp1, "does not fit": plain}
    assert result.dropped_example["out of memory"].startswith("out of memory: stage 0 needs")
    assert result.fitting == len(scored) == len(layouts) - tp1 - plain
    assert all(c.parallel.tensor_model_parallel_size > 1 and c.recompute.recompute_granularity for c in scored)


def test_a_bound_skips_layouts_that_cannot_reach_the_top_and_changes_nothing():
    """The dummy's exact upper bound: its compute and optimizer terms alone (the rest only add)."""
    def bound(cfg: RunConfig) -> float:
        terms = dummy_score(cfg).terms
        return 8 * 32 / (terms["forward/backward compute"] + terms["optimizer"])

    plain = search(base(), 8, fits=lambda c: True, score=dummy_score, top=3, gpus_per_node=8)
    pruned = search(base(), 8, fits=lambda c: True, score=dummy_score, top=3, gpus_per_node=8, bound=bound)
    assert [r.label for r in pruned.ranked] == [r.label for r in plain.ranked]
    assert [r.reason for r in pruned.ranked] == [r.reason for r in plain.ranked]
    assert pruned.skipped_by_bound > 0 and pruned.scored + pruned.skipped_by_bound == pruned.fitting


def test_top_must_be_positive_and_nothing_fitting_ranks_nothing():
    with pytest.raises(ConfigError, match="--top"):
        search(base(), 8, fits=lambda c: True, score=dummy_score, top=0, gpus_per_node=8)
    result = search(base(), 8, fits=lambda c: "too big: always", score=dummy_score, top=3, gpus_per_node=8)
    assert result.ranked == [] and result.dropped == {"too big": result.enumerated}


# ---- the calibrated bound, against the time model it bounds --------------------------------------------------------

def hardware(cfg: RunConfig):
    from ledger.models.simulate import hardware_calibration, load_hardware

    return hardware_calibration(cfg, load_hardware("H200"))


@pytest.mark.parametrize("flags", [
    "--world-size 8 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel",
    "--world-size 8 --pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2 "
    "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
    "--world-size 8 --pipeline-model-parallel-size 4 --recompute-granularity selective "
    "--untie-embeddings-and-output-weights",
    "--world-size 8 --pipeline-model-parallel-size 2 --recompute-granularity full --recompute-method block "
    "--recompute-num-layers 1"], ids=["tp-sp", "interleaved-full", "pp4-selective-untied", "full-block"])
def test_chunk_seconds_are_the_time_models_and_the_bound_never_exceeds_its_prediction(flags):
    """The calibrated bound prices one layer and scales it: it must give exactly what compute.stage_time gives
    chunk by chunk, and a step time no longer than predict_step's (else search could skip a layout of the top K)."""
    from ledger.models.simulate.bound import calibrated_min_step_seconds, chunk_seconds
    from ledger.models.time_model import predict_step, stage_time

    cfg = base(SMALL + " --micro-batch-size 1 --global-batch-size 16 " + flags)
    cal = hardware(cfg)
    for s, chunks in enumerate(chunk_seconds(cfg, cal)):
        expected = stage_time(cfg, cal, s).chunks
        assert [pytest.approx((c.forward.seconds, c.backward.seconds), rel=1e-12) for c in expected] == chunks
    assert calibrated_min_step_seconds(cfg, cal) <= predict_step(cfg, cal).step_time


def test_a_search_with_the_calibrated_bound_ranks_as_the_exhaustive_one():
    """The real time model on the H200 hardware file, 4 layers of hidden 4096 at seq 4096 on 8 GPUs: the bound skips
    most layouts and the top 3, their order and reasons are those of scoring everything. The bound is the device's
    (calibrated_bound): the shape keeps the GPUs busy, where a tiny model's steps are the host's and a device bound
    skips next to nothing."""
    from ledger.models.simulate.bound import calibrated_bound
    from ledger.models.time_model import predict_step

    cfg = base(SMALL.replace("--global-batch-size 8", "--global-batch-size 16")
               .replace("--hidden-size 64 --ffn-hidden-size 128", "--hidden-size 4096 --ffn-hidden-size 16384")
               .replace("--vocab-size 1000", "--vocab-size 32000")
               .replace("--seq-length 32", "--seq-length 4096 --max-position-embeddings 4096"))

    def score(c: RunConfig):
        return predict_step(c, hardware(c))

    plain = search(cfg, 8, fits=lambda c: True, score=score, top=3, gpus_per_node=8)
    pruned = search(cfg, 8, fits=lambda c: True, score=score, top=3, gpus_per_node=8, bound=calibrated_bound(hardware))
    assert [(r.label, r.reason) for r in pruned.ranked] == [(r.label, r.reason) for r in plain.ranked]
    assert pruned.skipped_by_bound > pruned.scored


def test_a_layout_of_more_micro_batches_than_the_time_model_walks_is_dropped_with_why():
    """Plumbing of the simulator's limit (simulation.MAX_MICROBATCHES): 16,385 micro-batches a replica is one too
    many; the search drops that layout with the reason rather than walk it."""
    pricing = Pricing(load_hardware("H200"))
    over = base(SMALL.replace("--global-batch-size 8", f"--global-batch-size {MAX_MICROBATCHES + 1}"))
    assert pricing.fits(over) == ("too many micro-batches: global batch 16,385 at micro-batch 1 over 1 "
                                  "data-parallel replica(s) is 16,385 a replica; the time model walks each, at "
                                  "most 16,384")
    at = base(SMALL.replace("--global-batch-size 8", f"--global-batch-size {MAX_MICROBATCHES}"))
    assert pricing.fits(at) is True
