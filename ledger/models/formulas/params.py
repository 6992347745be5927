"""Parameter counts of our Llama-style model, as Megatron Core registers and splits them.

The model (docs/formulas.md, "Parameters"): RMSNorm (weight only), GQA attention with a fused QKV projection, SwiGLU
MLP with a fused gate+up projection, no biases, a final norm, and an output layer that is the input embedding
(tied, Megatron's default) or a matrix of its own (--untie-embeddings-and-output-weights). The GPT style
(ModelConfig: swiglu False, add_bias_linear, LayerNorm, learned positions; for the formulas only) changes it the way
Megatron's GPT layer does: fc1 is f x h (GeLU, no gate), every linear has a bias (column-parallel biases split with
their output dim, row-parallel ones whole on every TP rank), each norm has a bias, and the first stage holds a
max_position_embeddings x h position table, whole on every TP rank (a plain embedding, not vocab-parallel). TP splits
every matrix (column-parallel: output dim; row-parallel: input dim; vocab-parallel: vocab dim) and replicates the
norms. Pipeline stages hold `num_layers / (pp x vpp)` layers per model chunk (uneven stages:
common.config.pipeline_layers); the embedding lives on the first chunk of pipeline rank 0, the final norm and
output layer on the last chunk of the last pipeline rank. Tied under PP > 1 the last stage holds a copy of the
embedding as its output layer's weight (Megatron's `shared_embedding`), kept equal to the first stage's by an
all-reduce of their gradients: a parameter of that stage, not of the model.

Mixture of experts (ModelConfig.num_experts = E; docs/formulas.md, "Mixture of experts"): every layer's MLP is a
router, a [E, h] matrix (Megatron's TopKRouter.weight: whole on every TP rank, marked sequence_parallel; a dense
parameter, reduced over dp x cp with the rest), and E SwiGLU experts each with its own linear_fc1 [2 f_moe, h] and
linear_fc2 [h, f_moe], split over TP as the dense MLP is (expert TP = tp, Megatron's default). The EP rank `ep_rank`
of an EP group of size EP holds the contiguous block of experts ep_rank x E/EP ... (ep_rank + 1) x E/EP - 1, named by
their global index (`mlp.experts.{e}.linear_fc1.weight`) and marked `expert` (Megatron's allreduce=False): they live
in buffers of their own, reduced and sharded over the expert-data-parallel group (buffer_layout.py).

Shapes are TP-local `(rows, cols)` in the order the engine registers them (model.parameters()); the buffer layout
walks that order reversed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from common.config import ModelConfig, RunConfig
from common.config.pipeline_layers import chunk_layer_numbers
from common.ops.sizes import fc1_width, padded_vocab


@dataclass(frozen=True)
class ParamTensor:
    """One registered parameter, TP-local. shared_embedding: one of the two pipeline-stage copies of tied word
    embeddings (the distributed optimizer gives it a bucket of its own, buffer_layout.py). replicated: held whole on
    every TP rank (norms, row-parallel biases, the position table). sequence_parallel: Megatron's attribute of that
    name, a replicated parameter whose gradient differs per TP rank under SP (it sees only the rank's sequence
    shard), so finalize_model_grads all-reduces it over TP: the norms and the row-parallel biases."""
    name: str
    shape: tuple[int, ...]
    shared_embedding: bool = False
    replicated: bool = False
    sequence_parallel: bool = False
    expert: bool = False  # an expert's weight (Megatron's allreduce=False): expert buffers, expert-dp group
    bucket_group: str = ""  # a grouped MoE layer's experts: no bucket closes between them (buffer_layout.py)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def norm_tensors(model: ModelConfig, name: str) -> list[ParamTensor]:
    """A norm's weight, and its bias under LayerNorm: replicated over TP, all-reduced under SP."""
    h = model.hidden_size
    return [ParamTensor(f"{name}.{kind}", (h,), replicated=True, sequence_parallel=True)
            for kind in ("weight", "bias")[:2 if model.layer_norm else 1]]


def linear_tensors(model: ModelConfig, name: str, out: int, inp: int, tp: int, column: bool) -> list[ParamTensor]:
    """A TP linear's weight (TP-local) and, with biases, its bias: split with the output of a column-parallel
    linear; whole on every rank of a row-parallel one (added after the reduction; all-reduced under SP)."""
    weight = ParamTensor(f"{name}.weight", (out // tp, inp) if column else (out, inp // tp))
    if not model.add_bias_linear:
        return [weight]
    bias = (ParamTensor(f"{name}.bias", (out // tp,)) if column
            else ParamTensor(f"{name}.bias", (out,), replicated=True, sequence_parallel=True))
    return [weight, bias]


def layer_tensors(model: ModelConfig, tp: int, layer: int, ep: int = 1, ep_rank: int = 0) -> list[ParamTensor]:
    """One transformer layer's parameters, TP-local, in registration order (an MoE layer's: this EP rank's
    experts)."""
    h, d, f = model.hidden_size, model.head_dim, model.ffn_hidden_size
    nq, nkv = model.num_attention_heads, model.num_query_groups
    prefix = f"decoder.layers.{layer}."
    mlp = (moe_tensors(model, tp, prefix + "mlp.", ep, ep_rank) if model.is_moe else [
        *linear_tensors(model, prefix + "mlp.linear_fc1", fc1_width(model), h, tp, column=True),
        *linear_tensors(model, prefix + "mlp.linear_fc2", h, f, tp, column=False)])
    return [
        *norm_tensors(model, prefix + "input_layernorm"),
        *linear_tensors(model, prefix + "self_attention.linear_qkv", (nq + 2 * nkv) * d, h, tp, column=True),
        *linear_tensors(model, prefix + "self_attention.linear_proj", h, nq * d, tp, column=False),
        *norm_tensors(model, prefix + "pre_mlp_layernorm"),
        *mlp,
    ]


def local_experts(model: ModelConfig, ep: int, ep_rank: int) -> range:
    """The global indices of the experts an EP rank holds: the contiguous block ep_rank x E/EP onwards."""
    per_rank = model.num_experts // ep
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


def moe_tensors(model: ModelConfig, tp: int, prefix: str, ep: int, ep_rank: int) -> list[ParamTensor]:
    """An MoE layer's router (dense: whole on every TP rank, all-reduced over TP under SP, as Megatron marks it) and
    this EP rank's experts, each a SwiGLU MLP of width f_moe split over TP, marked expert. Under --moe-grouped-gemm
    (the engine's GroupedMLP) the experts are registered last-first, so that the buffer lays them first expert first,
    and are one bucket group."""
    h, f = model.hidden_size, model.expert_ffn_hidden_size
    router = ParamTensor(prefix + "router.weight", (model.num_experts, h), replicated=True, sequence_parallel=True)
    experts = []
    order = local_experts(model, ep, ep_rank)
    group = prefix + "experts" if model.moe_grouped_gemm else ""
    for e in reversed(order) if model.moe_grouped_gemm else order:
        name = f"{prefix}experts.{e}."
        experts += [ParamTensor(name + "linear_fc1.weight", (2 * f // tp, h), expert=True, bucket_group=group),
                    ParamTensor(name + "linear_fc2.weight", (h, f // tp), expert=True, bucket_group=group)]
    return [router, *experts]


def embedding_copy_on_last_stage(cfg: RunConfig) -> bool:
    """Tied embeddings under PP > 1: the last stage's output layer holds a copy (Megatron's setup rule)."""
    return not cfg.model.untie_embeddings_and_output_weights and cfg.parallel.pipeline_model_parallel_size > 1


def layer_component_counts(model: ModelConfig) -> dict[str, int]:
    """One layer's count of each component: no mlp.gate in the GeLU MLP (fc1 is up alone); norms are weights, and
    biases too under LayerNorm; "biases" (only with add_bias_linear): the four linears' biases."""
    h, d, f = model.hidden_size, model.head_dim, model.ffn_hidden_size
    nq, nkv = model.num_attention_heads, model.num_query_groups
    if model.is_moe:  # E experts of f_moe (SwiGLU) and the router
        fe, e = model.expert_ffn_hidden_size, model.num_experts
        mlp = {"mlp.router": e * h, "mlp.experts.gate": e * h * fe, "mlp.experts.up": e * h * fe,
               "mlp.experts.down": e * fe * h}
    else:
        mlp = {**({"mlp.gate": h * f} if model.swiglu else {}), "mlp.up": h * f, "mlp.down": f * h}
    counts = {"attention.q": h * nq * d, "attention.k": h * nkv * d, "attention.v": h * nkv * d,
              "attention.o": nq * d * h, **mlp, "norms": 2 * h * (2 if model.layer_norm else 1)}
    if model.add_bias_linear:
        counts["biases"] = (nq + 2 * nkv) * d + h + fc1_width(model) + h
    return counts


def component_counts(model: ModelConfig, tp: int = 1) -> dict[str, int]:
    """Full-model count of each component (tp only matters through vocab padding): one layer's components, then the
    model's own. Tied, the output layer has no parameter of its own: it multiplies by the embedding's."""
    h = model.hidden_size
    vocab = padded_vocab(model, tp)
    positions = {"position_embedding": model.max_position_embeddings * h} if model.learned_positions else {}
    return {
        **layer_component_counts(model),
        "embedding": vocab * h,
        **positions,
        "output_layer": vocab * h if model.untie_embeddings_and_output_weights else 0,
        "final_norm": h * (2 if model.layer_norm else 1),
    }


def params_per_layer(model: ModelConfig) -> int:
    return sum(layer_component_counts(model).values())


def params_total(cfg: RunConfig) -> int:
    """All parameters of the model, with the vocab padded for this run's TP size; the tied embedding once (the last
    stage's copy under PP > 1 is a second memory location of one parameter, counted in params_per_stage)."""
    c = component_counts(cfg.model, cfg.parallel.tensor_model_parallel_size)
    return (cfg.model.num_layers * params_per_layer(cfg.model) + c["embedding"] + c.get("position_embedding", 0)
            + c["output_layer"] + c["final_norm"])


def num_chunks(cfg: RunConfig) -> int:
    return cfg.parallel.virtual_pipeline_model_parallel_size or 1


def chunk_layers(cfg: RunConfig, pp_rank: int, chunk: int) -> range:
    """Global layer indices of a model chunk: virtual stage `chunk * pp + pp_rank` (Megatron's interleaving), even
    or uneven stages (common.config.pipeline_layers)."""
    return chunk_layer_numbers(cfg.parallel, cfg.model.num_layers, pp_rank, chunk)


def chunk_tensors(cfg: RunConfig, pp_rank: int, chunk: int, ep_rank: int = 0) -> list[ParamTensor]:
    """A model chunk's parameters on one TP rank (of EP rank `ep_rank`: which experts, not how many), in the order
    the engine registers them."""
    model, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    pp, vpp = cfg.parallel.pipeline_model_parallel_size, num_chunks(cfg)
    h = model.hidden_size
    vocab = padded_vocab(model, tp)
    copy = embedding_copy_on_last_stage(cfg)
    tensors: list[ParamTensor] = []
    if pp_rank == 0 and chunk == 0:
        tensors.append(ParamTensor("embedding.word_embeddings.weight", (vocab // tp, h), shared_embedding=copy))
        if model.learned_positions:
            tensors.append(ParamTensor("embedding.position_embeddings.weight", (model.max_position_embeddings, h),
                                       replicated=True))
    for layer in chunk_layers(cfg, pp_rank, chunk):
        tensors += layer_tensors(model, tp, layer, cfg.parallel.expert_model_parallel_size, ep_rank)
    if pp_rank == pp - 1 and chunk == vpp - 1:
        tensors += norm_tensors(model, "decoder.final_layernorm")
        if model.untie_embeddings_and_output_weights or copy:
            tensors.append(ParamTensor("output_layer.weight", (vocab // tp, h), shared_embedding=copy))
    return tensors


def params_per_rank(cfg: RunConfig, pp_rank: int) -> int:
    """Parameters held by one TP rank of a pipeline rank (all its chunks): matrices split, norms replicated; of an
    MoE model its E/EP experts per layer."""
    return sum(t.numel for chunk in range(num_chunks(cfg)) for t in chunk_tensors(cfg, pp_rank, chunk))


def params_per_rank_split(cfg: RunConfig, pp_rank: int) -> dict[str, int]:
    """params_per_rank in its dense part (reduced over dp x cp) and its expert part (over the expert-dp group)."""
    tensors = [t for chunk in range(num_chunks(cfg)) for t in chunk_tensors(cfg, pp_rank, chunk)]
    expert = sum(t.numel for t in tensors if t.expert)
    return {"dense": sum(t.numel for t in tensors) - expert, "expert": expert}


def expert_params_total(model: ModelConfig) -> int:
    """Every expert's weights in the model (0 for a dense model): what top-k routing leaves mostly idle per token."""
    c = layer_component_counts(model)
    return model.num_layers * sum(n for name, n in c.items() if name.startswith("mlp.experts."))


def active_params(cfg: RunConfig) -> int:
    """Parameters one token passes through: the dense ones and k of the E experts of each layer (Mixtral's "12.9B
    active" of 46.7B)."""
    m = cfg.model
    experts = expert_params_total(m)
    return params_total(cfg) - experts + (experts * m.moe_router_topk // m.num_experts if m.is_moe else 0)


def params_per_stage(cfg: RunConfig) -> list[int]:
    """Parameters of each pipeline rank summed over its TP group (replicated ones counted once, not per TP rank),
    the last stage's copy of tied embeddings included."""
    tp, ep = cfg.parallel.tensor_model_parallel_size, cfg.parallel.expert_model_parallel_size
    per_stage = []
    for pp_rank in range(cfg.parallel.pipeline_model_parallel_size):
        tensors = [t for chunk in range(num_chunks(cfg)) for t in chunk_tensors(cfg, pp_rank, chunk)]
        replicated = sum(t.numel for t in tensors if t.replicated)
        expert = sum(t.numel for t in tensors if t.expert)  # E/EP experts here: the EP group holds all E
        per_stage.append((params_per_rank(cfg, pp_rank) - replicated - expert) * tp + replicated + expert * tp * ep)
    return per_stage
