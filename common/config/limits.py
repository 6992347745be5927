"""Every number's range: counts >= 1 and below bounds far beyond any real run, rates and coefficients finite.

Sizes far beyond any real run are refused rather than computed: the formulas enumerate layers and ranks, so a typo
such as --num-layers 100000000 would otherwise run for minutes. The largest public runs are far inside these.
"""
from __future__ import annotations

import math

from common.config.pipeline_layers import FIRST_FLAG, LAST_FLAG
from common.config.run_config import RunConfig
from common.errors import ConfigError

MAX_WORLD_SIZE = 65_536
MAX_LAYERS = 10_000
MAX_WIDTH = 1 << 20  # hidden, ffn, heads, query groups
MAX_TOKENS = 1 << 27  # sequence length, max position embeddings, vocabulary (128 Mi)
MAX_GLOBAL_BATCH = 1 << 24  # sequences a step (16 Mi): Llama 3 405B's 16M-token batch is 2,048 sequences of 8,192


def check_ranges(cfg: RunConfig) -> None:
    """Every number in range, one message naming the flag: counts >= 1 (and below the bounds above), rates and
    coefficients finite and >= 0, Adam's betas in [0, 1), epsilons > 0."""
    _check_counts(cfg)
    t = cfg.train
    if t.lr_decay_iters is not None and t.lr_decay_iters < 1:
        raise ConfigError(f"--lr-decay-iters must be >= 1, got {t.lr_decay_iters}")
    if t.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {t.seed}")
    _check_rates(cfg)


def _counts(cfg: RunConfig) -> list[tuple[str, int, int | None]]:
    """(flag, value, the largest allowed or None) of every count."""
    m, p, t, pr = cfg.model, cfg.parallel, cfg.train, cfg.probes
    return [("--num-layers", m.num_layers, MAX_LAYERS), ("--hidden-size", m.hidden_size, MAX_WIDTH),
            ("--ffn-hidden-size", m.ffn_hidden_size, MAX_WIDTH),
            ("--num-attention-heads", m.num_attention_heads, MAX_WIDTH),
            ("--num-query-groups", m.num_query_groups, MAX_WIDTH), ("--vocab-size", m.vocab_size, MAX_TOKENS),
            ("--seq-length", m.seq_length, MAX_TOKENS),
            ("--max-position-embeddings", m.max_position_embeddings, MAX_TOKENS),
            ("--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by, MAX_TOKENS),
            ("world size", p.world_size, MAX_WORLD_SIZE),
            ("--tensor-model-parallel-size", p.tensor_model_parallel_size, MAX_WORLD_SIZE),
            ("--pipeline-model-parallel-size", p.pipeline_model_parallel_size, MAX_WORLD_SIZE),
            ("--context-parallel-size", p.context_parallel_size, MAX_WORLD_SIZE),
            ("--expert-model-parallel-size", p.expert_model_parallel_size, MAX_WORLD_SIZE),
            ("--num-experts", m.num_experts if m.is_moe else 1, MAX_WIDTH),
            ("--moe-router-topk", m.moe_router_topk, MAX_WIDTH),
            ("--moe-ffn-hidden-size", m.expert_ffn_hidden_size, MAX_WIDTH),
            ("--virtual-pipeline-model-parallel-size", p.virtual_pipeline_model_parallel_size or 1, MAX_LAYERS),
            *((flag, count, MAX_LAYERS) for flag, count in
              ((FIRST_FLAG, p.decoder_first_pipeline_num_layers), (LAST_FLAG, p.decoder_last_pipeline_num_layers))
              if count is not None),
            ("--micro-batch-size", t.micro_batch_size, MAX_TOKENS),
            ("--global-batch-size", t.global_batch_size, MAX_GLOBAL_BATCH),
            ("--train-iters", t.train_iters, None), ("--log-interval", t.log_interval, None),
            ("--profile-step-start", pr.profile_step_start, None), ("--profile-step-end", pr.profile_step_end, None)]


def _check_counts(cfg: RunConfig) -> None:
    for flag, value, highest in _counts(cfg):
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
        if highest is not None and value > highest:
            raise ConfigError(f"{flag} {value:,} is beyond the largest supported value {highest:,}")


def _check_rates(cfg: RunConfig) -> None:
    m, t, pr = cfg.model, cfg.train, cfg.probes
    for flag, value in (("--lr", t.lr), ("--min-lr", t.min_lr), ("--lr-warmup-iters", t.lr_warmup_iters),
                        ("--moe-aux-loss-coeff", m.moe_aux_loss_coeff),
                        ("--weight-decay", t.weight_decay), ("--clip-grad", t.clip_grad),
                        ("--init-method-std", m.init_method_std), ("--nvml-interval", pr.nvml_interval)):
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"{flag} must be a finite number >= 0, got {value}")
    for flag, value in (("--adam-eps", t.adam_eps), ("--norm-epsilon", m.norm_epsilon),
                        ("--rotary-base", m.rotary_base)):
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{flag} must be a finite number > 0, got {value}")
    for flag, value in (("--adam-beta1", t.adam_beta1), ("--adam-beta2", t.adam_beta2)):
        if not (math.isfinite(value) and 0 <= value < 1):
            raise ConfigError(f"{flag} must be in [0, 1), got {value}")
