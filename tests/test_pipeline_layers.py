"""Which layers each pipeline stage and virtual chunk builds: even stages, Megatron-LM's uneven ones
(--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers) and its ends counted as layers
(--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split), as the engine builds them and
the ledger counts them (common.config.pipeline_layers serves both).

Expectations from the rule itself: even stages hold L / p contiguous layers; with v chunks the model is cut into v
rounds of L / v layers and each round dealt over the stages in order; uneven stages give the first / last stage
their own count and the stages between share the rest equally; counting the embedding (loss) as a layer adds a slot
to the first (last) virtual stage that holds no decoder layer.
"""
from __future__ import annotations

import re

import pytest

from common.arguments import parse_args
from common.config import ParallelConfig
from common.config.pipeline_layers import (
    check_pipeline_layers,
    chunk_layer_numbers,
    layout_stages,
    stage_num_layers,
    virtual_stage_layers,
)
from common.errors import ConfigError
from ledger.models.formulas import activations, params


def _parallel(pp: int, vpp: int | None = None, first: int | None = None, last: int | None = None,
              ends: tuple[bool, bool] = (False, False), layout: str | None = None) -> ParallelConfig:
    return ParallelConfig(world_size=pp, pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp,
                          decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last,
                          account_for_embedding_in_pipeline_split=ends[0], account_for_loss_in_pipeline_split=ends[1],
                          pipeline_model_parallel_layout=layout)


def _stage(p: ParallelConfig, num_layers: int, stage: int) -> list[int]:
    return [n for c in range(p.virtual_pipeline_model_parallel_size or 1)
            for n in chunk_layer_numbers(p, num_layers, stage, c)]


def test_even_stages_are_contiguous_without_vpp():
    assert [list(chunk_layer_numbers(_parallel(2), 16, s, 0)) for s in (0, 1)] == [list(range(8)), list(range(8, 16))]


def test_even_stages_interleave_chunks_with_vpp():
    p = _parallel(2, vpp=2)
    assert [list(chunk_layer_numbers(p, 8, 0, c)) for c in (0, 1)] == [[0, 1], [4, 5]]
    assert [list(chunk_layer_numbers(p, 8, 1, c)) for c in (0, 1)] == [[2, 3], [6, 7]]
    # 16 layers, PP 4, VPP 2: chunk c of stage 0 is virtual stage 4c, layers [2 x 4c, 2 x 4c + 2).
    assert _stage(_parallel(4, vpp=2), 16, 0) == [0, 1, 8, 9]


def test_llama3_405b_stages_hold_7_then_8_then_7():
    """126 layers over 16 stages, one fewer on the first and the last (Llama 3's balance for the embedding and the
    loss): 7 + 14 x 8 + 7."""
    p = _parallel(16, first=7, last=7)
    assert [stage_num_layers(p, 126, s) for s in range(16)] == [7] + [8] * 14 + [7]
    assert _stage(p, 126, 0) == list(range(7))
    assert _stage(p, 126, 1) == list(range(7, 15))
    assert _stage(p, 126, 15) == list(range(119, 126))


def test_uneven_interleaved_stages_deal_each_round_in_stage_order():
    """12 layers, PP 4, VPP 2, 2 on each end: stages hold 2, 4, 4, 2, so 1, 2, 2, 1 layers a chunk; round c covers
    layers [6c, 6c + 6)."""
    p = _parallel(4, vpp=2, first=2, last=2)
    assert [_stage(p, 12, s) for s in range(4)] == [[0, 6], [1, 2, 7, 8], [3, 4, 9, 10], [5, 11]]


def test_llama3_405b_as_published_one_layer_a_chunk_the_ends_alone():
    """Llama 3 405B (Section 3.3.2): one layer fewer on the first and the last stage, the first chunk of the first
    stage only the embedding, the last chunk of the last stage only the output layer and loss: 126 layers and the two
    ends as 128 slots over 16 stages x 8 chunks, one slot each."""
    p = _parallel(16, vpp=8, ends=(True, True))
    assert virtual_stage_layers(p, 126) == (0,) + (1,) * 126 + (0,)
    assert list(chunk_layer_numbers(p, 126, 0, 0)) == []  # the embedding alone
    assert _stage(p, 126, 0) == [15, 31, 47, 63, 79, 95, 111]  # virtual stage 16 c holds slot 16 c, layer 16 c - 1
    assert _stage(p, 126, 1) == [0, 16, 32, 48, 64, 80, 96, 112]
    assert list(chunk_layer_numbers(p, 126, 15, 7)) == []  # the loss alone
    assert [stage_num_layers(p, 126, s) for s in range(16)] == [7] + [8] * 14 + [7]


def test_a_layout_string_unrolls_as_megatrons():
    """Commas are cosmetic, "(...)*n" repeats a group (separators included), "x*n" a character."""
    assert layout_stages("Et*3|(tt|)*6,tL") == ("Ettt",) + ("tt",) * 6 + ("tL",)
    assert layout_stages("E|(t|)*2,t*2|L") == ("E", "t", "t", "tt", "L")


def test_llama3_405b_spelled_out_is_the_ends_counted_split():
    """The embedding alone, 126 virtual stages of one layer, the loss alone: 128 virtual stages over PP 16 give V 8,
    and the same layers a chunk as counting the ends as layers."""
    spelled = _parallel(16, vpp=8, layout="E|(t|)*126,L")
    assert virtual_stage_layers(spelled, 126) == virtual_stage_layers(_parallel(16, vpp=8, ends=(True, True)), 126)
    check_pipeline_layers(spelled, 126)


def test_a_layout_places_uneven_chunks():
    """8 layers over PP 4 x V 2 as "Et|tt|t|t|t|t|t|L": stage 0 holds virtual stages 0 and 4 (layers 0 and 5),
    stage 1 the two of vs 1 (1, 2) and vs 5 (6), stage 3 vs 3 (4) and the loss alone."""
    p = _parallel(4, vpp=2, layout="Et|tt|t|t|t|t|t|L")
    assert [_stage(p, 8, s) for s in range(4)] == [[0, 5], [1, 2, 6], [3, 7], [4]]
    assert [stage_num_layers(p, 8, s) for s in range(4)] == [2, 3, 2, 1]


def test_only_the_first_stage_given():
    p = _parallel(3, first=2)
    assert [_stage(p, 8, s) for s in range(3)] == [[0, 1], [2, 3, 4], [5, 6, 7]]


def test_every_layer_once_over_the_stages():
    for p, layers in ((_parallel(16, first=7, last=7), 126), (_parallel(4, vpp=2, first=2, last=2), 12),
                      (_parallel(4, vpp=2), 16), (_parallel(3, last=1), 7),
                      (_parallel(16, vpp=8, ends=(True, True)), 126), (_parallel(3, ends=(True, False)), 8)):
        every = sorted(n for s in range(p.pipeline_model_parallel_size) for n in _stage(p, layers, s))
        assert every == list(range(layers))


@pytest.mark.parametrize("parallel, layers, message", [
    (_parallel(4), 10, "not divisible by pipeline size 4"),
    (_parallel(1, first=2), 4, "only with --pipeline-model-parallel-size > 1"),
    (_parallel(4, vpp=2, first=3, last=2), 12, "--decoder-first-pipeline-num-layers 3 is not divisible by virtual"),
    (_parallel(4, first=1, last=1), 7, "the 5 middle layers are not divisible by 2 middle stage(s)"),
    (_parallel(3, first=2, last=2), 4, "leave 0 of --num-layers 4 for 1 middle stage(s)"),
    (_parallel(2, first=3, last=3), 4, "leave -2 of --num-layers 4 for 0 middle stage(s)"),
    (_parallel(4, ends=(True, False)), 8, "--num-layers 8 + the embedding / loss counted as layers (9) is not "
                                          "divisible by pipeline size 4"),
    (_parallel(4, first=2, ends=(True, False)), 8, "are alternatives"),
    (_parallel(1, ends=(False, True)), 8, "only with --pipeline-model-parallel-size > 1"),
    (_parallel(2, vpp=2, layout="Et|t|t|L", ends=(True, True)), 2, "are alternatives"),
    (_parallel(2, layout="Et|t|tL"), 3, "has 3 virtual stage(s): not 1 for each of 2 pipeline stages"),
    (_parallel(2, layout="tE|tL"), 2, "the embedding (E) must open the first virtual stage"),
    (_parallel(2, layout="Et|LtL"), 2, "the loss (L) close the last, each once"),
    (_parallel(2, layout="Et|tL"), 3, "places 2 decoder layer(s) (t), not --num-layers 3"),
], ids=["even-indivisible", "no-pipeline", "first-not-chunks", "middle-indivisible", "empty-middle", "too-many",
        "ends-indivisible", "both-kinds", "ends-no-pipeline", "layout-and-ends", "layout-not-whole-rounds",
        "layout-embedding-not-first", "layout-two-losses", "layout-layer-count"])
def test_splits_megatron_refuses(parallel, layers, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        check_pipeline_layers(parallel, layers)


@pytest.mark.parametrize("pp_rank, chunk", [(2, 0), (0, 3)])
def test_chunk_outside_the_pipeline(pp_rank, chunk):
    with pytest.raises(ConfigError, match="outside a pipeline"):
        chunk_layer_numbers(_parallel(2, vpp=2), 8, pp_rank, chunk)


def _config(*flags: str, world: int):
    return parse_args(["--model", "tiny", "--num-layers", "4", "--global-batch-size", "8", *flags],
                      world_size=world)


def test_flags_reach_the_ledger_per_stage():
    """Megatron-LM's flags parse, and the ledger counts each stage's own layers: parameters and saved activations
    per micro-batch scale with the stage's layer count (4 layers as 1, 2, 1)."""
    cfg = _config("--pipeline-model-parallel-size", "3", "--decoder-first-pipeline-num-layers", "1",
                  "--decoder-last-pipeline-num-layers", "1", world=3)
    assert [activations.layers_per_chunk(cfg, s, 0) for s in range(3)] == [1, 2, 1]
    layer = params.params_per_layer(cfg.model)
    assert params.params_per_rank(cfg, 1) == 2 * layer  # a middle stage: layers only
    saved = [activations.chunk_activation_bytes(cfg, s, 0).saved for s in range(3)]
    assert saved == [activations.layer_bytes(cfg), 2 * activations.layer_bytes(cfg), activations.layer_bytes(cfg)]


@pytest.mark.parametrize("flags, message", [
    (["--decoder-first-pipeline-num-layers", "0", "--pipeline-model-parallel-size", "2"],
     "--decoder-first-pipeline-num-layers must be >= 1, got 0"),
    (["--decoder-last-pipeline-num-layers", "2"], "only with --pipeline-model-parallel-size > 1"),
    (["--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2",
      "--num-layers-per-virtual-pipeline-stage", "1"], "assumes even stages"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|t|t|tL",
      "--virtual-pipeline-model-parallel-size", "3"], "--virtual-pipeline-model-parallel-size 3 contradicts"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|t|tL"],
     "has 3 virtual stage(s), not a multiple of pipeline size 2"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|m|t|tL"],
     "m (multi-token prediction layers are not built)"),
    (["--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "E(t|)*99999999L"],
     "beyond the longest layout supported"),
], ids=["zero", "no-pipeline", "layers-per-virtual-stage", "layout-contradicts-vpp", "layout-not-whole-rounds",
        "layout-mtp", "layout-huge"])
def test_bad_flags_one_line(flags, message):
    world = 2 if "--pipeline-model-parallel-size" in flags else 1
    with pytest.raises(ConfigError, match=re.escape(message)):
        _config(*flags, world=world)


def test_held_activations_walk_the_schedule_where_chunks_differ():
    """2 layers, PP 2, VPP 2, both ends counted: stage 0's chunk 0 is the embedding alone (nothing saved), its chunk 1
    one layer (S saved, P at its backward's peak). Its order (Megatron's interleaving, 4 micro-batches) runs four
    warm-up forwards (chunks 0, 0, 1, 1), then pairs F(c0) B(c1), F(c0) B(c1), F(c1) B(c0), F(c1) B(c0): at most two
    layer chunks are saved at a forward's end (not the five chunk-micro-batches in flight), S + P during a backward."""
    cfg = _config("--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
                  "--num-layers", "2", "--account-for-embedding-in-pipeline-split",
                  "--account-for-loss-in-pipeline-split", "--global-batch-size", "4", world=2)
    assert cfg.num_microbatches == 4 and activations.in_flight(cfg, 0) == 5
    layer = activations.chunk_activation_bytes(cfg, 0, 1)
    assert activations.chunk_activation_bytes(cfg, 0, 0).saved == 0
    held = activations.held_chunks(cfg, 0)
    assert (held.forward_end, held.in_backward) == (2 * layer.saved, layer.saved + layer.backward_peak)


def test_a_layout_sets_the_virtual_size_and_reaches_the_checkpoint_layout():
    """4 virtual stages over PP 2: V 2, as Megatron derives it; the layout string is part of what a checkpoint's
    files depend on."""
    from common.config import checkpoint_layout

    cfg = _config("--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et|tt|t|L", world=2)
    assert cfg.parallel.virtual_pipeline_model_parallel_size == 2
    assert [activations.stage_chunk_layers(cfg, s) for s in range(2)] == [(1, 1), (2, 0)]
    assert checkpoint_layout(cfg)["pipeline_model_parallel_layout"] == "Et|tt|t|L"
