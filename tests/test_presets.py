"""Each --model preset is its published model: the parameter count its publisher gives, by the ledger's formula and
by the engine's own model (built on the meta device: shapes, no memory), with the output layer tied or not as the
published config says; --untie-embeddings-and-output-weights still unties a tied preset; and a run recorded before a
preset carried its published tying is read as it was recorded.

The published counts: the total of each model's released weights (the safetensors index of meta-llama/Llama-3.2-1B,
Llama-3.1-8B, Llama-3.1-70B and mistralai/Mixtral-8x7B-v0.1), whose config.json says tie_word_embeddings true for
Llama-3.2-1B and false for the others; GPT-3: 175.0 B (Brown et al. 2020, Table 2.1), to its three figures.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from common.arguments import parse_args
from common.config import PRESETS, TYING_SOURCES, RunConfig, tying_reason
from common.run_dir import iter_events, read_manifest
from ledger.models.formulas import params

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PUBLISHED = {  # preset: (parameters, tied)
    "llama3.2-1b": (1_235_814_400, True),
    "llama3.1-8b": (8_030_261_248, False),
    "llama3.1-70b": (70_553_706_496, False),
    "mixtral-8x7b": (46_702_792_704, False),
}


def config(*flags: str) -> RunConfig:
    return parse_args(list(flags), world_size=1)


def engine_count(cfg: RunConfig) -> int:
    """The engine's GPTModel of the whole config on one rank, on the meta device."""
    from engine.models.gpt_model import build_model_chunks
    from engine.parallel_state import ParallelState

    state = ParallelState(rank=0, world_size=1, tp_size=1, pp_size=1, dp_size=1, cp_size=1, tp_rank=0, pp_rank=0,
                          dp_rank=0, cp_rank=0)
    (model,) = build_model_chunks(cfg, state, "meta")
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("preset", PUBLISHED)
def test_each_preset_has_its_published_parameter_count_and_tying(preset: str):
    count, tied = PUBLISHED[preset]
    cfg = config("--model", preset)
    assert cfg.model.untie_embeddings_and_output_weights is not tied
    assert params.params_total(cfg) == count
    assert engine_count(cfg) == count


def test_gpt3_is_tied_as_megatron_trains_it_and_has_its_published_size():
    cfg = parse_args(["--model", "gpt3-175b"], world_size=1, megatron_model=True)
    assert not cfg.model.untie_embeddings_and_output_weights
    assert round(params.params_total(cfg), -9) == 175_000_000_000  # 174,604,836,864: the GPT-2 vocabulary's 50,257


def test_only_the_toy_presets_are_unpublished():
    assert set(PRESETS) - set(PUBLISHED) == {"tiny", "gpt3-175b", "mixtral-8x7b-2l"}
    assert PRESETS["mixtral-8x7b-2l"]["untie_embeddings_and_output_weights"]  # Mixtral's config, cut to 2 layers


def test_the_flag_unties_a_tied_preset_and_restates_an_untied_one():
    untied = config("--model", "llama3.2-1b", "--untie-embeddings-and-output-weights")
    h, v = untied.model.hidden_size, untied.model.vocab_size
    assert params.params_total(untied) == engine_count(untied) == 1_235_814_400 + v * h == 1_498_482_688
    assert config("--model", "llama3.1-8b", "--untie-embeddings-and-output-weights") == config("--model", "llama3.1-8b")


def test_the_reason_names_the_published_config_the_flag_or_megatrons_default():
    assert tying_reason("llama3.1-8b", True) == "as Llama-3.1-8B's published config: tie_word_embeddings false"
    assert tying_reason("llama3.2-1b", False) == "as Llama-3.2-1B's published config: tie_word_embeddings true"
    assert tying_reason("llama3.2-1b", True) == "by --untie-embeddings-and-output-weights"
    assert tying_reason(None, True) == "by --untie-embeddings-and-output-weights"
    assert tying_reason(None, False) == "by Megatron's default: no --untie-embeddings-and-output-weights"
    assert set(TYING_SOURCES) == set(PRESETS)  # every preset says where its tying comes from


@pytest.mark.parametrize("run", ["8b-4layers", "8b-8layers-s8192-selective"])
def test_a_run_recorded_with_the_tied_llama31_preset_is_read_as_recorded(run: str):
    """Real H200 runs of --model llama3.1-8b cut to fewer layers, recorded when the preset was tied: the manifest's
    config decides, not today's preset. The engine's parameter buffer as the run measured it holds the vocabulary
    matrix once, as the recorded config's formula count says."""
    run_dir = FIXTURES / "h200_llama1b" / run
    cfg = RunConfig.from_dict(read_manifest(run_dir)["config"])
    assert cfg.model_preset == "llama3.1-8b" and not cfg.model.untie_embeddings_and_output_weights
    buffer = next(e for e in iter_events(run_dir, 0, {"inventory"}) if e.tensor_kind == "param_buffer")
    h, v = cfg.model.hidden_size, cfg.model.vocab_size
    assert buffer.numel == params.params_total(cfg) == cfg.model.num_layers * params.params_per_layer(cfg.model) \
        + v * h + h
    today = config("--model", "llama3.1-8b", "--num-layers", str(cfg.model.num_layers))
    assert params.params_total(today) == buffer.numel + v * h
    assert tying_reason(cfg.model_preset, False) == ("as the run's config recorded it, before the llama3.1-8b preset "
                                                     "carried its published tying")
