"""Which flags of a Megatron-LM command line change what the ledger predicts (memory, time, FLOPs, communication):

  used           read by the ledger's flag parser (the model's shape and flavour, the layout, batch, precision,
                 DDP, recompute) or by the implementation (common/megatron/implementation.py)
  not affecting  flags that change no prediction: the tokenizer and the data, evaluation, logging and profiling,
                 checkpoints, the learning-rate schedule and the optimizer's hyper-parameters, seeds and timeouts
  not modelled   every other flag Megatron-LM knows: the prediction assumes its default (named, never guessed at)
"""
from __future__ import annotations

from dataclasses import dataclass

from common.arguments import build_parser
from common.megatron.options import CommandLine

IMPLEMENTATION_DESTS = frozenset({
    "transformer_impl", "attention_backend", "masked_softmax_fusion", "attention_softmax_in_fp32",
    "apply_query_key_layer_scaling", "attention_dropout", "hidden_dropout", "gradient_accumulation_fusion",
    "bias_swiglu_fusion", "apply_rope_fusion", "create_attention_mask_in_dataloader", "optimizer", "spec"})
# Megatron's destinations for flags our parser keeps under another name (ledger/evidence/megatron/arguments.py).
ALIASES = frozenset({"layernorm_epsilon", "add_bias_linear", "group_query_attention",
                     "num_virtual_stages_per_pipeline_rank"})
NOT_AFFECTING_PREFIXES = (
    "tokenizer_", "vocab_file", "merge_file", "vocab_extra_ids", "data_path", "data_cache_path", "data_args_path",
    "train_data", "valid_data", "test_data",
    "per_split_data", "split", "mock_data", "num_workers", "dataloader_", "num_dataset_builder_threads", "mmap_",
    "object_storage", "reset_position_ids", "reset_attention_mask", "eod_mask_loss", "eval_", "full_validation",
    "multiple_validation_sets", "skip_train", "log_", "tensorboard_", "wandb_", "timing_log", "profile",
    "use_pytorch_profiler", "pytorch_profiler", "nvtx", "record_memory_history", "memory_snapshot_path",
    "save", "load", "ckpt_", "auto_detect_ckpt_format", "use_dist_ckpt", "dist_ckpt", "async_save", "no_load_",
    "finetune", "pretrained_checkpoint", "use_checkpoint_args", "exit_", "non_persistent_", "lr", "min_lr",
    "weight_decay", "start_weight_decay", "end_weight_decay", "adam_", "clip_grad", "train_iters", "train_samples",
    "seed", "data_parallel_random_init", "init_method", "distributed_timeout_minutes", "distributed_backend",
    "barrier_with_l1_time", "check_for_", "rerun_", "error_injection", "result_rejected_tracker_filename",
    "deprecated_use_mcore_models", "use_legacy_models", "no_persist_layer_norm", "rotary_seq_len_interpolation_factor",
    "one_logger", "app_tag", "enable_one_logger", "straggler", "manual_gc", "inprocess_", "heartbeat",
    "enable_ft", "calc_ft_timeouts", "ft_", "adlr_autoresume", "logging_level", "legacy_tokenizer", "hf_",
    "tiktoken", "null_tokenizer", "sft", "disable_msc", "enable_msc", "world_size", "rank", "local_rank")


@dataclass(frozen=True)
class FlagEffects:
    used: tuple[str, ...]
    not_affecting: tuple[str, ...]
    not_modelled: tuple[str, ...]


def read_dests() -> frozenset[str]:
    """Every Megatron destination a prediction reads."""
    parser = build_parser("megatron-lm", megatron_model=True)
    ours = {a.dest for a in parser._actions if a.option_strings}  # noqa: SLF001 - argparse has no public list
    return frozenset(ours) | IMPLEMENTATION_DESTS | ALIASES


def classify(line: CommandLine) -> FlagEffects:
    """The flags as written on the line, each in one group, in the line's order (a flag of the ledger's parser that
    changes no prediction, --lr or --tensorboard-dir, is not affecting)."""
    reads = read_dests()
    used, inert, other = [], [], []
    for flag, dest in line.given:
        group = inert if dest.lower().startswith(NOT_AFFECTING_PREFIXES) else used if dest in reads else other
        group.append(flag)
    return FlagEffects(tuple(used), tuple(inert), tuple(other))
