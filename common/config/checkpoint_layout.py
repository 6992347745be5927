"""The checkpoint directory's contract (engine/checkpointing.py writes it), torch-free so that the launcher can check a
--load before any rank starts. Megatron's names: DIR/iter_0000005/ per save, and the pointer file written last, so a
checkpoint is visible only once complete; layout.json records what the per-rank files depend on."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from common.config.parallel_config import ParallelConfig
from common.config.pipeline_layers import PIPELINE_SPLIT_FIELDS, check_pipeline_layers
from common.config.run_config import RunConfig
from common.errors import ConfigError

LATEST_CHECKPOINT_FILE = "latest_checkpointed_iteration.txt"
CHECKPOINT_LAYOUT_FILE = "layout.json"  # written by rank 0 after every rank's file: its presence marks a whole save
# The model fields that decide the parameters' shapes, hence the per-rank files' contents.
LAYOUT_MODEL_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                       "vocab_size", "make_vocab_size_divisible_by", "untie_embeddings_and_output_weights")


def checkpoint_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def checkpoint_layout(cfg: RunConfig) -> dict[str, Any]:
    """What a rank's checkpoint file depends on: the parameters' shapes, how they are split over ranks (tp, pp, vpp,
    dp through the world size), the DDP buffers' layout (dtypes, bucket size, distributed optimizer shards), and the
    batch sizes, which give the saved data position (micro-batches consumed) its meaning."""
    p, t = cfg.parallel, cfg.train
    return {"world_size": p.world_size, "tensor_model_parallel_size": p.tensor_model_parallel_size,
            "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
            "context_parallel_size": p.context_parallel_size,
            "virtual_pipeline_model_parallel_size": p.virtual_pipeline_model_parallel_size,
            **{name: getattr(p, name) for name in PIPELINE_SPLIT_FIELDS},
            "params_dtype": t.params_dtype, "grad_dtype": t.grad_dtype,
            "use_distributed_optimizer": t.use_distributed_optimizer, "overlap_grad_reduce": t.overlap_grad_reduce,
            "ddp_bucket_size": t.ddp_bucket_size, "global_batch_size": t.global_batch_size,
            "micro_batch_size": t.micro_batch_size,
            **{name: getattr(cfg.model, name) for name in LAYOUT_MODEL_FIELDS},
            "num_experts": cfg.model.num_experts,
            "moe_ffn_hidden_size": cfg.model.expert_ffn_hidden_size if cfg.model.is_moe else None,
            "expert_model_parallel_size": p.expert_model_parallel_size}


# Keys added to layout.json after checkpoints were first written, with the value an older checkpoint meant.
LAYOUT_DEFAULTS = {"num_experts": None, "moe_ffn_hidden_size": None, "expert_model_parallel_size": 1,
                   "decoder_first_pipeline_num_layers": None, "decoder_last_pipeline_num_layers": None,
                   "account_for_embedding_in_pipeline_split": False, "account_for_loss_in_pipeline_split": False,
                   "pipeline_model_parallel_layout": None}


def layout_differences(cfg: RunConfig, saved: dict[str, Any]) -> list[str]:
    """The checkpoint_layout keys whose saved value differs from this run's (a key an older layout.json lacks
    counts as its LAYOUT_DEFAULTS value): none means this rank's own file loads as it is."""
    return [key for key, value in checkpoint_layout(cfg).items() if saved.get(key, LAYOUT_DEFAULTS.get(key)) != value]


def latest_checkpoint(load_dir: str) -> int | None:
    """The iteration of the newest complete checkpoint in load_dir; None when there is none (no pointer file)."""
    pointer = Path(load_dir) / LATEST_CHECKPOINT_FILE
    if not pointer.is_file():
        return None
    text = pointer.read_text().strip()
    if not text.isdigit():
        raise ConfigError(f"--load {load_dir}: {LATEST_CHECKPOINT_FILE} holds {text!r}, not an iteration")
    iteration = int(text)
    if not (Path(load_dir) / checkpoint_dir_name(iteration) / CHECKPOINT_LAYOUT_FILE).is_file():
        raise ConfigError(f"--load {load_dir}: {LATEST_CHECKPOINT_FILE} names iteration {iteration}, but "
                          f"{checkpoint_dir_name(iteration)}/{CHECKPOINT_LAYOUT_FILE} is missing")
    return iteration


def check_load_layout(cfg: RunConfig) -> None:
    """A checkpoint loads at another parallel layout (engine.checkpoint_reshard rebuilds each parameter's state by
    name and cuts it anew: world size, tp, pp, cp, vpp, ep, the pipeline split, DDP buckets, micro-batch size), but
    only into the same model shape (the number of experts included), precision, optimizer and global batch size (the
    saved state and data position mean nothing in another): those are refused up front, the first difference named,
    rather than failing inside the ranks."""
    reshardable = ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                   "context_parallel_size", "virtual_pipeline_model_parallel_size", "overlap_grad_reduce",
                   "ddp_bucket_size", "micro_batch_size", "expert_model_parallel_size", *PIPELINE_SPLIT_FIELDS)
    load = cfg.checkpoint.load
    iteration = latest_checkpoint(load) if load is not None else None
    if iteration is None:
        return
    name = checkpoint_dir_name(iteration)
    path = Path(load) / name / CHECKPOINT_LAYOUT_FILE
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--load {load}: cannot read {path.name} of {name}: {exc}") from exc
    if not isinstance(saved, dict) or any(key not in saved and key not in LAYOUT_DEFAULTS for key in reshardable):
        raise ConfigError(f"--load {load}: {name}/{path.name} does not record the saving run's parallel layout")
    mine = checkpoint_layout(cfg)
    for key in layout_differences(cfg, saved):
        if key not in reshardable:
            raise ConfigError(f"--load {load}: {name} was saved with {key} {saved.get(key, LAYOUT_DEFAULTS.get(key))}"
                              f", this run has {mine[key]}; a checkpoint reshards to another parallel layout, DDP "
                              "bucket size or micro-batch size, but loads only into the same model shape, precision, "
                              "optimizer and global batch size")
    _check_saved_split(saved, f"--load {load}: {name}/{path.name}")


def _check_saved_split(saved: dict[str, Any], where: str) -> None:
    """The saving run's layers split over its stages as its layout.json records them (a layout written before the
    split was recorded, by a run of uneven stages, splits evenly here and would not)."""
    split = {key: saved.get(key, LAYOUT_DEFAULTS[key]) for key in PIPELINE_SPLIT_FIELDS}
    p = ParallelConfig(pipeline_model_parallel_size=saved["pipeline_model_parallel_size"],
                       virtual_pipeline_model_parallel_size=saved["virtual_pipeline_model_parallel_size"], **split)
    try:
        check_pipeline_layers(p, saved["num_layers"])
    except ConfigError as exc:
        raise ConfigError(f"{where} records a pipeline split its layers do not fit: {exc}") from exc

