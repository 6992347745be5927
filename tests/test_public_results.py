"""Published results through the simulator (ledger/models/simulate/published.py): how each published step time is
implied, what is assumed where a paper is silent, and what is skipped and why. The accuracy itself (predicted vs
published per entry) is a measurement and lives in BENCHMARKS.md (runs/bench/public_results.py); these tests hold the
plumbing that produces it."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest

from common.arguments import parse_args
from common.ops import Shapes
from ledger.models.simulate.published import (
    Comparison,
    Skipped,
    compare,
    entry_config,
    entry_flags,
    load_entries,
)

DATA = Path(__file__).resolve().parent / "data" / "public_results.json"


@pytest.fixture(scope="module")
def entries() -> dict[str, dict]:
    return {e["id"]: e for e in load_entries(DATA)}


def test_narayanans_tflops_imply_the_step_time_by_their_own_count(entries):
    """GPT 1.7B row: 24 layers, h 2304, V 51200, s 2048, batch 512 on 32 A100s at 137 TFLOP/s: Eq. 3 gives
    96 x 512 x 2048 x 24 x 2304^2 x (1 + 2048/13824 + 51200/884736) FLOPs, over 137e12 x 32 FLOP/s."""
    r = compare(entries["narayanan2021-table1-gpt-1p7b"], {})
    flops = 96 * 512 * 2048 * 24 * 2304 ** 2 * (1 + 2048 / (6 * 2304) + 51200 / (16 * 24 * 2304))
    assert isinstance(r, Comparison) and r.hardware == "A100-80GB" and r.gpus == 32
    assert r.published_s == pytest.approx(flops / (137e12 * 32))
    assert "micro-batch 1" in r.assumptions and "Narayanan" in r.published_from
    assert r.error == pytest.approx((r.predicted_s - r.published_s) / r.published_s)


def test_a_published_iteration_time_is_taken_as_it_is(entries):
    r = compare(entries["korthikanti2022-gpt-175b-selective-sp"], {})
    assert isinstance(r, Comparison) and r.published_s == 13.75 and r.published_from == "iteration time"
    assert r.predicted_s > 0 and "no interleaving" in r.assumptions


def test_unstated_recompute_is_the_least_that_fits(entries):
    """MT-NLG 530B on A100-80GB, tp 8 x pp 35, micro-batch 1: without recompute one stage's activations exceed
    80 GB, so the comparison assumes full recompute, and says so."""
    r = compare(entries["smith2022-mtnlg-530b-2240gpu"], {})
    assert isinstance(r, Comparison)
    assert any(a.startswith("recompute full") for a in r.assumptions)


def test_what_cannot_be_simulated_is_skipped_with_its_reason(entries):
    r = compare(entries["korthikanti2022-gpt-530b-2240gpu-abstract"], {})
    assert isinstance(r, Skipped) and "layout (tp, pp) is not given" in r.reason


def test_llamas_mfu_implies_the_step_time_by_palms_count(entries):
    """The Llama 3 405B 8K row goes through the PaLM-MFU branch: tokens x (6N + 12 L q s) / (MFU x peak x GPUs)."""
    r = compare(entries["llama3-405b-8k-context-8192gpu"], {})
    assert isinstance(r, Comparison) and r.hardware == "H100" and "MFU 43%" in r.published_from


@pytest.mark.parametrize("entry_id", ["llama3-405b-8k-context-8192gpu", "llama3-405b-128k-context-16384gpu"])
def test_llamas_126_layers_split_as_its_paper_says(entries, entry_id):
    """126 layers over PP 16 with the embedding and the loss each a chunk of their own (one layer a chunk, 8 chunks a
    stage): simulated, not skipped, and stated as derived rather than assumed; with them taken away the 126 layers do
    not split and the entry is skipped for it."""
    r = compare(entries[entry_id], {})
    assert isinstance(r, Comparison) and "no interleaving" not in r.assumptions
    e = copy.deepcopy(entries[entry_id])
    e["layout"]["account_for_embedding_in_pipeline_split"] = e["layout"]["account_for_loss_in_pipeline_split"] = False
    r = compare(e, {})
    assert isinstance(r, Skipped)
    assert "--num-layers 126 is not divisible by pipeline size 16 x virtual size 8" in r.reason


def test_a_2021_run_computes_megatrons_unfused_attention_with_its_fused_softmax(entries):
    """The 2021-2022 entries name the attention their runs computed (`implementation`): Megatron-LM's own, Q K^T and
    P V over the whole score matrix and the softmax in its fused kernel (one pass: the scores read, the probabilities
    written), where this project's flash attention would hide the s x s traffic those runs paid. An attention the
    simulator does not model is skipped with its reason."""
    entry = entries["narayanan2021-table1-gpt-1p7b"]
    cfg = entry_config(entry, entry_flags(entry)[0])
    assert cfg.implementation.megatron and cfg.implementation.unfused_attention
    assert Shapes.of(cfg).megatron.fused_softmax  # 1 x 24 heads: a batch count the fused kernel takes
    flash = parse_args(entry_flags(entry)[0], prog="public results", megatron_model=True)
    assert not flash.implementation.megatron  # without the block: this project's layers
    r = compare(entry, {})
    e = copy.deepcopy(entry)
    del e["implementation"]
    assert r.predicted_s > compare(e, {}).predicted_s  # the score matrix's GEMMs and softmax cost more than flash's
    e["implementation"] = {"attention": "ring"}
    assert isinstance(compare(e, {}), Skipped) and "only 'unfused' is modelled" in compare(e, {}).reason


def test_the_fused_softmax_needs_a_batch_count_its_kernel_takes(entries):
    """Megatron's kernel takes b x heads/t a multiple of 4 (common/ops/sizes.py fused_softmax): GPT 18.4B's 48 heads
    over TP 8 at micro-batch 1 give 6, so that run's softmax is torch's chain (masked_fill_, softmax)."""
    entry = entries["narayanan2021-table1-gpt-18p4b"]
    assert (entry["model"]["num_attention_heads"], entry["layout"]["tensor_model_parallel_size"]) == (48, 8)
    megatron = Shapes.of(entry_config(entry, entry_flags(entry)[0])).megatron
    assert megatron.unfused_attention and not megatron.fused_softmax


@pytest.mark.parametrize("entry_id", ["llama3-405b-8k-context-8192gpu", "llama3-405b-8k-context-16384gpu"])
def test_a_stated_recompute_setting_is_run_as_stated(entries, entry_id):
    """Llama 3's 8K rows: Section 3.3.2 says they trained 'without activation checkpointing' (`none`), so the
    comparison recomputes nothing and assumes nothing about it; left unstated, the same entry would run the least
    recompute that fits this project's memory model (full at TP 8 without sequence parallelism), a third more forward
    work and a slower step."""
    stated = compare(entries[entry_id], {})
    assert isinstance(stated, Comparison) and not any("recompute" in a for a in stated.assumptions)
    e = copy.deepcopy(entries[entry_id])
    e["layout"]["recompute_granularity"] = None
    unstated = compare(e, {})
    assert "recompute full (not stated; the least that fits the device)" in unstated.assumptions
    assert stated.predicted_s < 0.9 * unstated.predicted_s
