"""Parameter counts of our Llama-style model, as Megatron Core registers and splits them.

The model (docs/formulas.md, "Parameters"): RMSNorm (weight only), GQA attention with a fused QKV projection, SwiGLU
MLP with a fused gate+up projection, no biases, a final norm, and an output layer that is the input embedding
(tied, Megatron's default) or a matrix of its own (--untie-embeddings-and-output-weights). TP splits every matrix
(column-parallel: output dim; row-parallel: input dim; vocab-parallel: vocab dim) and replicates the norms. Pipeline
stages hold `num_layers / (pp x vpp)` layers per model chunk; the embedding lives on the first chunk of pipeline rank
0, the final norm and output layer on the last chunk of the last pipeline rank. Tied under PP > 1 the last stage
holds a copy of the embedding as its output layer's weight (Megatron's `shared_embedding`), kept equal to the first
stage's by an all-reduce of their gradients: a parameter of that stage, not of the model.

Shapes are TP-local `(rows, cols)` in the order the engine registers them (model.parameters()); the buffer layout
walks that order reversed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from common.config import ModelConfig, RunConfig


@dataclass(frozen=True)
class ParamTensor:
    """One registered parameter, TP-local. shared_embedding: one of the two pipeline-stage copies of tied word
    embeddings (the distributed optimizer gives it a bucket of its own, buffer_layout.py)."""
    name: str
    shape: tuple[int, ...]
    shared_embedding: bool = False

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def padded_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp: int) -> int:
    """Megatron's `_vocab_size_with_padding`: round up to a multiple of divisible_by x tp so each TP rank holds an
    equal, aligned slice of the vocab. The padded rows are real parameters (they count in every figure)."""
    multiple = make_vocab_size_divisible_by * tp
    return -(-vocab_size // multiple) * multiple


def layer_tensors(model: ModelConfig, tp: int, layer: int) -> list[ParamTensor]:
    """One transformer layer's parameters, TP-local, in registration order."""
    h, d, f = model.hidden_size, model.head_dim, model.ffn_hidden_size
    nq, nkv = model.num_attention_heads, model.num_query_groups
    prefix = f"decoder.layers.{layer}."
    return [
        ParamTensor(prefix + "input_layernorm.weight", (h,)),
        ParamTensor(prefix + "self_attention.linear_qkv.weight", ((nq + 2 * nkv) * d // tp, h)),
        ParamTensor(prefix + "self_attention.linear_proj.weight", (h, nq * d // tp)),
        ParamTensor(prefix + "pre_mlp_layernorm.weight", (h,)),
        ParamTensor(prefix + "mlp.linear_fc1.weight", (2 * f // tp, h)),
        ParamTensor(prefix + "mlp.linear_fc2.weight", (h, f // tp)),
    ]


def embedding_copy_on_last_stage(cfg: RunConfig) -> bool:
    """Tied embeddings under PP > 1: the last stage's output layer holds a copy (Megatron's setup rule)."""
    return not cfg.model.untie_embeddings_and_output_weights and cfg.parallel.pipeline_model_parallel_size > 1


def component_counts(model: ModelConfig, tp: int = 1) -> dict[str, int]:
    """Full-model count of each component (tp only matters through vocab padding). Tied, the output layer has no
    parameter of its own: it multiplies by the embedding's."""
    h, d, f = model.hidden_size, model.head_dim, model.ffn_hidden_size
    nq, nkv = model.num_attention_heads, model.num_query_groups
    vocab = padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, tp)
    return {
        "attention.q": h * nq * d,
        "attention.k": h * nkv * d,
        "attention.v": h * nkv * d,
        "attention.o": nq * d * h,
        "mlp.gate": h * f,
        "mlp.up": h * f,
        "mlp.down": f * h,
        "norms": 2 * h,
        "embedding": vocab * h,
        "output_layer": vocab * h if model.untie_embeddings_and_output_weights else 0,
        "final_norm": h,
    }


def params_per_layer(model: ModelConfig) -> int:
    c = component_counts(model)
    return sum(c[k] for k in ("attention.q", "attention.k", "attention.v", "attention.o",
                              "mlp.gate", "mlp.up", "mlp.down", "norms"))


def params_total(cfg: RunConfig) -> int:
    """All parameters of the model, with the vocab padded for this run's TP size; the tied embedding once (the last
    stage's copy under PP > 1 is a second memory location of one parameter, counted in params_per_stage)."""
    c = component_counts(cfg.model, cfg.parallel.tensor_model_parallel_size)
    return (cfg.model.num_layers * params_per_layer(cfg.model) + c["embedding"] + c["output_layer"]
            + c["final_norm"])


def num_chunks(cfg: RunConfig) -> int:
    return cfg.parallel.virtual_pipeline_model_parallel_size or 1


def chunk_layers(cfg: RunConfig, pp_rank: int, chunk: int) -> range:
    """Global layer indices of a model chunk: virtual stage `chunk * pp + pp_rank` (Megatron's interleaving)."""
    pp = cfg.parallel.pipeline_model_parallel_size
    per_chunk = cfg.model.num_layers // (pp * num_chunks(cfg))
    first = (chunk * pp + pp_rank) * per_chunk
    return range(first, first + per_chunk)


def chunk_tensors(cfg: RunConfig, pp_rank: int, chunk: int) -> list[ParamTensor]:
    """A model chunk's parameters on one TP rank, in the order the engine registers them."""
    model, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    pp, vpp = cfg.parallel.pipeline_model_parallel_size, num_chunks(cfg)
    h = model.hidden_size
    vocab = padded_vocab_size(model.vocab_size, model.make_vocab_size_divisible_by, tp)
    copy = embedding_copy_on_last_stage(cfg)
    tensors: list[ParamTensor] = []
    if pp_rank == 0 and chunk == 0:
        tensors.append(ParamTensor("embedding.word_embeddings.weight", (vocab // tp, h), shared_embedding=copy))
    for layer in chunk_layers(cfg, pp_rank, chunk):
        tensors += layer_tensors(model, tp, layer)
    if pp_rank == pp - 1 and chunk == vpp - 1:
        tensors.append(ParamTensor("decoder.final_layernorm.weight", (h,)))
        if model.untie_embeddings_and_output_weights or copy:
            tensors.append(ParamTensor("output_layer.weight", (vocab // tp, h), shared_embedding=copy))
    return tensors


def params_per_rank(cfg: RunConfig, pp_rank: int) -> int:
    """Parameters held by one TP rank of a pipeline rank (all its chunks): matrices split, norms replicated."""
    return sum(t.numel for chunk in range(num_chunks(cfg)) for t in chunk_tensors(cfg, pp_rank, chunk))


def params_per_stage(cfg: RunConfig) -> list[int]:
    """Parameters of each pipeline rank summed over its TP group (norms counted once, not per TP rank), the last
    stage's copy of tied embeddings included."""
    tp = cfg.parallel.tensor_model_parallel_size
    per_stage = []
    for pp_rank in range(cfg.parallel.pipeline_model_parallel_size):
        replicated = sum(t.numel for chunk in range(num_chunks(cfg)) for t in chunk_tensors(cfg, pp_rank, chunk)
                         if len(t.shape) == 1)
        per_stage.append((params_per_rank(cfg, pp_rank) - replicated) * tp + replicated)
    return per_stage
