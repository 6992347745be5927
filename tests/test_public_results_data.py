"""tests/data/public_results.json: published large-scale training results, held to their own arithmetic.

Plumbing only. These tests check that the file parses, that every entry names its source, and that each entry's
numbers agree with one another (tp x cp x pp x dp = GPUs, the batch splits into micro-batches, a percentage of peak
matches the TFLOP/s it came from). They cannot tell whether a number matches its paper: that was checked by hand when
the file was written, and each entry's `seen_in`, `verification` and `notes` say where every number was read and
which ones are from memory. `train-ledger simulate` is checked against these figures elsewhere.
"""
from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest

DATA = Path(__file__).parent / "data" / "public_results.json"

SOURCE_FIELDS = ("title", "authors", "year", "arxiv", "table", "url", "seen_in", "verification")
MODEL_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "group_query_attention",
                "num_query_groups", "vocab_size", "seq_length", "swiglu", "untie_embeddings_and_output_weights",
                "add_bias_linear", "normalization", "position_embedding_type")
LAYOUT_FIELDS = ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size",
                 "data_parallel_size", "virtual_pipeline_model_parallel_size", "micro_batch_size", "global_batch_size",
                 "recompute_granularity", "use_distributed_optimizer", "sequence_parallel")
GPUS = {"A100-80GB", "A100-40GB", "H100-80GB"}
RECOMPUTE = {"full", "selective", "none", None}
FIGURES = ("tflops_per_gpu", "mfu", "iteration_time_s")


def _entries() -> list[dict[str, Any]]:
    return json.loads(DATA.read_text())["entries"]


ENTRIES = _entries()


def _by_id(param: dict[str, Any]) -> str:
    return param["id"]


def test_the_file_parses_and_ids_are_unique_and_stable() -> None:
    ids = [e["id"] for e in ENTRIES]
    assert ids, "no entries"
    assert len(ids) == len(set(ids)), "duplicate ids"
    for entry_id in ids:
        assert re.fullmatch(r"[a-z0-9]+(-[a-z0-9]+)+", entry_id), f"{entry_id}: ids are lower-case words joined by -"


@pytest.mark.parametrize("entry", ENTRIES, ids=_by_id)
def test_every_entry_names_its_source(entry: dict[str, Any]) -> None:
    source = entry["source"]
    for field in SOURCE_FIELDS:
        assert source.get(field), f"{entry['id']}: source.{field} is missing or empty"
    assert isinstance(source["authors"], list) and all(isinstance(a, str) for a in source["authors"])
    assert isinstance(source["year"], int) and 2019 <= source["year"] <= 2030
    assert re.fullmatch(r"\d{4}\.\d{5}", source["arxiv"]), source["arxiv"]
    assert source["url"].startswith(f"https://arxiv.org/abs/{source['arxiv']}"), source["url"]
    assert isinstance(source["seen_in"], list) and source["seen_in"]


@pytest.mark.parametrize("entry", ENTRIES, ids=_by_id)
def test_every_entry_has_hardware_model_layout_and_a_figure(entry: dict[str, Any]) -> None:
    assert entry["hardware"]["gpu"] in GPUS, entry["hardware"]["gpu"]
    assert entry["hardware"]["gpus_per_node"] == 8
    assert entry["hardware"]["interconnect"]
    assert set(MODEL_FIELDS) <= entry["model"].keys()
    assert set(LAYOUT_FIELDS) <= entry["layout"].keys()
    assert entry["layout"]["recompute_granularity"] in RECOMPUTE
    published = entry["published"]
    assert any(published.get(f) is not None for f in FIGURES), f"{entry['id']}: no published figure"
    assert published["flops_convention"], f"{entry['id']}: say what the figure counts"


@pytest.mark.parametrize("entry", ENTRIES, ids=_by_id)
def test_a_null_is_declared_unstated(entry: dict[str, Any]) -> None:
    """A null means 'the sources did not say'; the entry must list it, so a forgotten field cannot pass as one."""
    unstated = set(entry["unstated"])
    for section, fields in (("model", MODEL_FIELDS), ("layout", LAYOUT_FIELDS)):
        for field in fields:
            if entry[section][field] is not None:
                continue
            if section == "model" and field == "num_query_groups" and entry["model"]["group_query_attention"] is False:
                continue  # multi-head attention: no query groups to state
            assert f"{section}.{field}" in unstated, f"{entry['id']}: {section}.{field} is null but not unstated"
    for path in entry["derived"]:
        section, field = path.split(" ", 1)[0].split(".")
        assert entry[section][field] is not None, f"{entry['id']}: derived {path} is null"


SIZES = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size", "data_parallel_size")
# Entries whose source gives every parallel size (the others say which they leave unstated: test above).
FULL_LAYOUT = [e for e in ENTRIES if e["layout"]["world_size"] is not None
               and all(e["layout"][k] is not None for k in SIZES)]
WITH_BATCH = [e for e in ENTRIES if e["layout"]["global_batch_size"] is not None
              and e["layout"]["data_parallel_size"] is not None]
CROSS_CHECKED = ("percent_of_peak", "aggregate_pflops", "tokens_per_batch", "hfu")
WITH_TWO_FIGURES = [e for e in ENTRIES if any(e["published"].get(k) is not None for k in CROSS_CHECKED)]


def test_most_entries_can_be_cross_checked():
    assert len(FULL_LAYOUT) >= 20 and len(WITH_BATCH) >= 20 and len(WITH_TWO_FIGURES) >= 15


@pytest.mark.parametrize("entry", FULL_LAYOUT, ids=_by_id)
def test_the_layout_multiplies_out(entry: dict[str, Any]) -> None:
    lay = entry["layout"]
    assert math.prod(lay[k] for k in SIZES) == lay["world_size"], f"{entry['id']}: tp x pp x cp x dp != GPUs"


@pytest.mark.parametrize("entry", WITH_BATCH, ids=_by_id)
def test_the_global_batch_splits_into_micro_batches_per_replica(entry: dict[str, Any]) -> None:
    lay = entry["layout"]
    per_replica = (lay["micro_batch_size"] or 1) * lay["data_parallel_size"]
    assert lay["global_batch_size"] % per_replica == 0, f"{entry['id']}: global batch % (micro batch x dp) != 0"


@pytest.mark.parametrize("entry", WITH_TWO_FIGURES, ids=_by_id)
def test_published_figures_agree_with_each_other(entry: dict[str, Any]) -> None:
    """Catches transcription slips: the table's own columns must be consistent to their rounding."""
    pub, peak, gpus = entry["published"], entry["hardware"]["peak_tflops_per_gpu"], entry["layout"]["world_size"]
    checked = False
    if pub.get("percent_of_peak") is not None:
        assert round(100 * pub["tflops_per_gpu"] / peak) == pub["percent_of_peak"]
        checked = True
    if pub.get("aggregate_pflops") is not None:  # TFLOP/s are rounded to integers, so allow 1%
        assert pub["tflops_per_gpu"] * gpus / 1000 == pytest.approx(pub["aggregate_pflops"], rel=0.01)
        checked = True
    if pub.get("tokens_per_batch") is not None:  # "16M" tokens, 2**20 to an M
        tokens = entry["layout"]["global_batch_size"] * entry["model"]["seq_length"]
        assert tokens == pytest.approx(int(pub["tokens_per_batch"].rstrip("M")) * 2**20, rel=0.05)
        checked = True
    if pub.get("hfu") is not None:
        assert pub["mfu"] <= pub["hfu"] <= 1, "hardware FLOPs count the recompute too, so HFU >= MFU"
        checked = True
    assert checked
