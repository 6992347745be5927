"""The model's sizes as one rank sees them: the padded vocabulary, linear_fc1's width, a CP rank's tokens, the tokens
an MoE layer routes and the assignments its experts keep under uniform routing, and the bytes of an element of each
dtype. Pure arithmetic on the config, shared by the catalogue (shapes.py) and the ledger's formulas
(docs/formulas.md derives each).
"""
from __future__ import annotations

import math

from common.config import ModelConfig, RunConfig

DTYPE_BYTES: dict[str, int] = {"fp32": 4, "bf16": 2, "fp16": 2}


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp: int) -> int:
    """Megatron's `_vocab_size_with_padding`: round up to a multiple of divisible_by x tp so each TP rank holds an
    equal, aligned slice of the vocab. The padded rows are real parameters (they count in every figure)."""
    multiple = make_vocab_size_divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def padded_vocab(model: ModelConfig, tp: int) -> int:
    """The model's vocabulary padded for `tp` ranks: the output layer's (and the embedding's) rows over all of them."""
    return padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, tp)


def vocab_shard(cfg: RunConfig) -> int:
    """The output layer's columns on one TP rank: the padded vocabulary (a multiple of t) over t."""
    t = cfg.parallel.tensor_model_parallel_size
    return padded_vocab(cfg.model, t) // t


def fc1_width(model: ModelConfig) -> int:
    """linear_fc1's output width: 2f under SwiGLU (gate and up fused), f for the GeLU MLP."""
    return 2 * model.ffn_hidden_size if model.swiglu else model.ffn_hidden_size


def local_seq_length(cfg: RunConfig) -> int:
    """Tokens of one sequence on one CP rank: s / C (validate: s divisible by 2C, Megatron's load-balancing rule)."""
    return cfg.model.seq_length // cfg.parallel.context_parallel_size


# Megatron's is_kernel_available for the fused scale-mask-softmax: 16 < sk <= 4096, sq, sk and b x heads multiples
# of 4 (its batch-per-block condition needs the CUDA extension and is taken as met).
FUSED_SOFTMAX_MAX_SEQ = 4096


def score_batches(cfg: RunConfig) -> int:
    """b x heads/t: the score matrices one micro-batch holds on one TP rank."""
    return cfg.train.micro_batch_size * (cfg.model.num_attention_heads // cfg.parallel.tensor_model_parallel_size)


def score_elements(cfg: RunConfig) -> int:
    """E: the [b, heads/t, s, s] score matrix's elements (one micro-batch, one TP rank)."""
    s = local_seq_length(cfg)
    return score_batches(cfg) * s * s


def fused_softmax(cfg: RunConfig) -> bool:
    """Megatron's fused scale-mask-softmax kernel runs: requested (--masked-softmax-fusion, Megatron's default) and
    the shape is one the kernel takes; otherwise torch's softmax does the work."""
    impl = cfg.implementation
    s = local_seq_length(cfg)
    return (impl.masked_softmax_fusion and cfg.train.params_dtype != "fp32" and 16 < s <= FUSED_SOFTMAX_MAX_SEQ
            and s % 4 == 0 and score_batches(cfg) % 4 == 0)


def routed_tokens(cfg: RunConfig) -> int:
    """Tokens one rank routes per micro-batch: its s/C x b, split over TP under sequence parallelism (which Megatron
    requires for MoE at tp > 1)."""
    sp = cfg.parallel.tensor_model_parallel_size if cfg.parallel.sequence_parallel else 1
    return local_seq_length(cfg) * cfg.train.micro_batch_size // sp


def expert_capacity(tokens: int, model: ModelConfig) -> int | None:
    """Assignments each expert keeps of one rank's micro-batch of `tokens` tokens: Megatron's get_capacity over the
    T k assignments; None without a capacity factor."""
    cf = model.moe_expert_capacity_factor
    if cf is None:
        return None
    return math.ceil(tokens * model.moe_router_topk / model.num_experts * cf)


def padded_rows(rows: int, multiple: int | None) -> int:
    """An expert's rows under --moe-pad-expert-rows: up to a multiple of it (None: as they are)."""
    return -(-rows // multiple) * multiple if multiple else rows


def uniform_kept_assignments(tokens: int, model: ModelConfig) -> int:
    """Kept assignments of one rank's micro-batch under uniform routing (each expert gets T k / E, capped at its
    capacity): what the rank sends, and, every rank routing alike, what its experts receive."""
    assignments = tokens * model.moe_router_topk
    capacity = expert_capacity(tokens, model)
    if capacity is None:
        return assignments
    return min(assignments, model.num_experts * capacity)
