"""Published large-scale results as a second check of the simulator (issue 18, item 4): each entry of
tests/data/public_results.json (layout, model, GPU and the achieved figure, with its source) run through `simulate`
on the matching hardware file, its predicted step time against the one the paper implies.

The comparison is made on step (iteration) time, the one figure free of FLOP-counting conventions:
  * where the paper gives its iteration time, that time;
  * where it gives TFLOP/s per GPU counted as Narayanan et al. 2021 count them (Eq. 3: the GEMMs and the logit layer
    with activation recomputation, 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) per iteration), that count over
    TFLOP/s x GPUs;
  * where it gives an MFU in PaLM's convention (Llama 3), our palm_6n FLOPs per step (ledger/models/formulas/flops.py)
  over
    MFU x the hardware file's peak x GPUs.
An entry's `implementation` names the attention its run computed where that is not this project's flash attention:
the 2021-2022 runs computed Megatron-LM's own (Q K^T and P V as batched GEMMs over the whole score matrix, its fused
scale-mask-softmax kernel where the shape allows it; common/ops/megatron.py). What a paper leaves unstated is filled
with a stated assumption (micro-batch 1, no interleaving, no distributed
optimizer, no sequence parallelism: Megatron-LM's defaults of the time; recompute: the least that fits the device)
and listed beside the figure; entries whose
layout the simulator cannot express (a layout not given) are reported as skipped, with the reason. Uneven stages
are Megatron-LM's flags: Llama 3 405B's 126 layers over 16 stages are its paper's split, the embedding and the loss
each a chunk of their own (--account-for-embedding/loss-in-pipeline-split, 8 chunks of one layer a stage).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from common.arguments import parse_args
from common.config import RunConfig
from common.config.implementation_config import LOCAL, UNFUSED
from common.errors import ConfigError
from ledger.models.formulas.flops import palm_flops_per_token, tokens_per_step
from ledger.models.simulate.hardware import Hardware, load_hardware
from ledger.models.simulate.pricing import Pricing

RECOMPUTE: dict[str | None, list[str]] = {
    None: [], "none": [], "selective": ["--recompute-granularity", "selective"],
    "full": ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]}
HARDWARE = {"A100-80GB": "A100-80GB", "A100-40GB": "A100-40GB", "H100-80GB": "H100", "H100": "H100", "H200": "H200"}


@dataclass(frozen=True)
class Comparison:
    id: str
    hardware: str
    gpus: int
    predicted_s: float
    published_s: float
    published_from: str  # which published figure the time is implied by
    assumptions: tuple[str, ...]

    @property
    def error(self) -> float:
        return (self.predicted_s - self.published_s) / self.published_s


@dataclass(frozen=True)
class Skipped:
    id: str
    reason: str


def load_entries(path: str | Path) -> list[dict[str, Any]]:
    return json.loads(Path(path).read_text())["entries"]


def entry_flags(entry: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Megatron flags for the entry's model and layout, and the assumptions made for what it leaves unstated."""
    m, lay = entry["model"], entry["layout"]
    if lay.get("tensor_model_parallel_size") is None or lay.get("pipeline_model_parallel_size") is None:
        raise ConfigError("the layout (tp, pp) is not given")
    flags = ["--num-layers", m["num_layers"], "--hidden-size", m["hidden_size"], "--ffn-hidden-size",
             m["ffn_hidden_size"], "--num-attention-heads", m["num_attention_heads"], "--vocab-size", m["vocab_size"],
             "--seq-length", m["seq_length"], "--max-position-embeddings", m["seq_length"], "--bf16",
             "--world-size", lay["world_size"], "--tensor-model-parallel-size", lay["tensor_model_parallel_size"],
             "--pipeline-model-parallel-size", lay["pipeline_model_parallel_size"],
             "--context-parallel-size", lay.get("context_parallel_size") or 1,
             "--global-batch-size", lay["global_batch_size"]]
    assumed = []
    if m.get("num_query_groups"):
        flags += ["--group-query-attention", "--num-query-groups", m["num_query_groups"]]
    if m.get("swiglu"):
        flags += ["--swiglu", "--disable-bias-linear", "--normalization", "RMSNorm",
                  "--position-embedding-type", "rope"]
    if m.get("untie_embeddings_and_output_weights"):
        flags.append("--untie-embeddings-and-output-weights")
    mbs = lay.get("micro_batch_size")
    if mbs is None:
        mbs = 1
        assumed.append("micro-batch 1")
    flags += ["--micro-batch-size", mbs]
    if lay.get("virtual_pipeline_model_parallel_size"):
        flags += ["--virtual-pipeline-model-parallel-size", lay["virtual_pipeline_model_parallel_size"]]
    elif lay["pipeline_model_parallel_size"] > 1:
        assumed.append("no interleaving")
    for key in ("account_for_embedding_in_pipeline_split", "account_for_loss_in_pipeline_split"):
        if lay.get(key):
            flags.append("--" + key.replace("_", "-"))
    for key in ("decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers"):
        if lay.get(key) is not None:
            flags += ["--" + key.replace("_", "-"), lay[key]]
    flags += RECOMPUTE[lay.get("recompute_granularity")]
    if lay.get("use_distributed_optimizer"):
        flags.append("--use-distributed-optimizer")
    elif lay.get("use_distributed_optimizer") is None:
        assumed.append("no distributed optimizer")
    if lay.get("sequence_parallel"):
        flags.append("--sequence-parallel")
    elif lay.get("sequence_parallel") is None:
        assumed.append("no sequence parallelism")
    return [str(f) for f in flags], assumed


def narayanan_flops_per_step(cfg: RunConfig) -> float:
    """Narayanan et al. 2021, Eq. 3 (activation recomputation counted): 96 B s l h^2 (1 + s/(6h) + V/(16 l h))."""
    m = cfg.model
    b, s, layers, h, v = cfg.train.global_batch_size, m.seq_length, m.num_layers, m.hidden_size, m.vocab_size
    return 96 * b * s * layers * h * h * (1 + s / (6 * h) + v / (16 * layers * h))


def published_step_seconds(entry: dict[str, Any], cfg: RunConfig, hw: Hardware) -> tuple[float, str]:
    pub, gpus = entry["published"], cfg.parallel.world_size
    convention = pub.get("flops_convention") or ""
    if pub.get("iteration_time_s"):
        return float(pub["iteration_time_s"]), "iteration time"
    if pub.get("tflops_per_gpu") and "96*B*s*l*h^2" in convention:
        return (narayanan_flops_per_step(cfg) / (pub["tflops_per_gpu"] * 1e12 * gpus),
                f"{pub['tflops_per_gpu']} TFLOP/s per GPU (Narayanan's count)")
    if pub.get("mfu") and "PaLM" in convention:
        flops = palm_flops_per_token(cfg) * tokens_per_step(cfg)
        return (flops / (pub["mfu"] * hw.peak(cfg.train.params_dtype) * gpus),
                f"MFU {pub['mfu']:.0%} (PaLM's count, the hardware file's peak)")
    raise ConfigError("no iteration time, TFLOP/s in Narayanan's count or PaLM MFU to compare with")


def compare(entry: dict[str, Any], pricings: dict[str, Pricing]) -> Comparison | Skipped:
    try:
        gpu = HARDWARE.get(entry["hardware"]["gpu"])
        if gpu is None:
            raise ConfigError(f"no hardware file for {entry['hardware']['gpu']}")
        flags, assumed = entry_flags(entry)
        pricing = pricings.setdefault(gpu, Pricing(load_hardware(gpu)))
        cfg = entry_config(entry, flags)
        if entry["layout"].get("recompute_granularity") is None:
            cfg, mode = least_recompute_that_fits(entry, flags, pricing)
            assumed.append(f"recompute {mode} (not stated; the least that fits the device)")
        published, source = published_step_seconds(entry, cfg, pricing.hardware)
        predicted = pricing.predict(cfg).step_time
    except ConfigError as exc:
        return Skipped(entry["id"], str(exc))
    return Comparison(entry["id"], gpu, cfg.parallel.world_size, predicted, published, source, tuple(assumed))


def entry_config(entry: dict[str, Any], flags: list[str]) -> RunConfig:
    """The entry's configuration: its Megatron flags, and the attention its run computed where the entry names one
    (`implementation`: Megatron-LM's own unfused attention, its softmax fused or not), else this project's flash
    attention."""
    cfg = parse_args(flags, prog="public results", megatron_model=True)
    impl = entry.get("implementation")
    if not impl:
        return cfg
    if impl.get("attention") != UNFUSED:
        raise ConfigError(f"implementation.attention {impl.get('attention')!r}: only {UNFUSED!r} is modelled")
    return replace(cfg, implementation=replace(cfg.implementation, transformer_impl=LOCAL, attention_backend=UNFUSED,
                                               masked_softmax_fusion=bool(impl.get("masked_softmax_fusion"))))


def least_recompute_that_fits(entry: dict[str, Any], flags: list[str], pricing: Pricing) -> tuple[RunConfig, str]:
    """Where a paper does not say how it recomputed: none if the layout fits the device without, else selective,
    else full (what a user of Megatron-LM would try, in that order)."""
    cfg = None
    for mode in (None, "selective", "full"):
        cfg = entry_config(entry, flags + RECOMPUTE[mode])
        if pricing.fits(cfg) is True:
            return cfg, mode or "none"
    return cfg, "full, and it still does not fit"


def compare_all(entries: list[dict[str, Any]]) -> list[Comparison | Skipped]:
    pricings: dict[str, Pricing] = {}
    return [compare(e, pricings) for e in entries]
