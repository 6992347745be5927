"""The GPT-style model in the ledger (issue 18): Megatron's layer without --swiglu, --disable-bias-linear,
--normalization RMSNorm and --position-embedding-type rope: fc1 f x h with GeLU, biases on every linear, LayerNorm with
a bias, a learned position table. For the formulas (simulate / search) only: `train` and `plan` keep the Llama style
the engine runs, and the engine refuses anything else.

Expectations are derived here from the shapes (GPT-3 175B: Brown et al. 2020, Table 2.1), not copied from the code.
"""
from __future__ import annotations

import dataclasses

import pytest

from common.arguments import parse_args
from common.config import RunConfig
from common.errors import ConfigError
from common.ops.sizes import padded_vocab_size
from ledger.models.formulas import activations, comm, flops, params
from ledger.models.time_model import ops

GPT3 = "--model gpt3-175b --bf16 --micro-batch-size 1 --global-batch-size 1536"
L, H, HEADS, SEQ, VOCAB = 96, 12288, 96, 2048, 50257
# An explicit GPT shape as a Megatron script gives it: no --swiglu, no --disable-bias-linear, no --ffn-hidden-size.
GPT_FLAGS = "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --vocab-size 1000 --seq-length 64 --bf16"
LLAMA_FLAGS = GPT_FLAGS + " --swiglu --disable-bias-linear --normalization RMSNorm --position-embedding-type rope"


def simulated(flags: str) -> RunConfig:
    """As simulate / search parse their flags: Megatron's semantics for the layer's flavour."""
    return parse_args(flags.split(), megatron_model=True)


def with_model(cfg: RunConfig, **changes) -> RunConfig:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, **changes))


# ---- parameters ---------------------------------------------------------------------------------------------------

def test_gpt3_175b_has_the_published_parameter_count():
    """Per layer: QKV 3h^2 + 3h, projection h^2 + h, fc1 4h^2 + 4h, fc2 4h^2 + h, two LayerNorms 2 x 2h: 12h^2 + 13h.
    The model: 96 layers, the word table at the vocabulary padded to a multiple of 128 (50,304), the 2,048 x h
    position table, the final LayerNorm 2h; tied output layer. 174.6B, the "175B" of the paper."""
    per_layer = 12 * H * H + 13 * H
    padded = 50304
    expected = L * per_layer + padded * H + SEQ * H + 2 * H
    cfg = simulated(GPT3)
    assert params.params_per_layer(cfg.model) == per_layer == 1_812_099_072
    assert params.params_total(cfg) == expected == 174_604_836_864
    assert sum(params.params_per_stage(cfg)) == expected  # one stage: the split adds nothing


def test_tp_splits_the_gpt_matrices_and_column_biases_and_replicates_the_rest():
    """At tp 8 each rank holds 1/8 of every matrix, of the QKV and fc1 biases, and of the padded vocabulary (51,200:
    a multiple of 128 x 8); the row-parallel biases, the LayerNorms and the position table whole. Summed over the TP
    group with the replicated ones once, the model's count at that padding."""
    cfg = simulated(GPT3 + " --world-size 8 --tensor-model-parallel-size 8")
    per_rank_layer = (12 * H * H + 3 * H + 4 * H) // 8 + H + H + 4 * H
    assert params.params_per_rank(cfg, 0) == L * per_rank_layer + 51200 * H // 8 + SEQ * H + 2 * H
    assert sum(params.params_per_stage(cfg)) == params.params_total(cfg) == \
        L * (12 * H * H + 13 * H) + (51200 + SEQ) * H + 2 * H


def test_the_gelu_mlp_has_one_f_by_h_matrix_where_swiglu_has_two():
    gelu, swiglu = simulated(GPT_FLAGS), simulated(GPT_FLAGS + " --swiglu --ffn-hidden-size 1024")
    f = 1024
    assert gelu.model.ffn_hidden_size == 4 * 256 == f  # Megatron's default without --swiglu
    fc1 = {c.model.swiglu: [t for t in params.layer_tensors(c.model, 1, 0) if t.name.endswith("linear_fc1.weight")]
           for c in (gelu, swiglu)}
    assert fc1[False][0].shape == (f, 256) and fc1[True][0].shape == (2 * f, 256)
    assert "mlp.gate" not in params.component_counts(gelu.model)


# ---- flavour flags -------------------------------------------------------------------------------------------------

def test_an_explicit_shape_follows_megatrons_defaults_under_simulate():
    m = simulated(GPT_FLAGS).model
    assert (m.swiglu, m.add_bias_linear, m.normalization, m.position_embedding_type) == (
        False, True, "LayerNorm", "learned_absolute")
    assert simulated(LLAMA_FLAGS).model.llama_style
    # --swiglu without --ffn-hidden-size: Megatron's int(8h/3 / 64) x 64
    assert simulated(GPT_FLAGS + " --swiglu").model.ffn_hidden_size == int(4 * 256 * 2 / 3 / 64) * 64 == 640


def test_a_preset_carries_its_own_flavour():
    assert simulated("--model llama3.1-8b").model.llama_style
    assert not simulated("--model gpt3-175b").model.swiglu
    assert simulated("--model gpt3-175b --swiglu").model.swiglu  # explicit flags override the preset


def test_train_and_plan_keep_the_llama_style():
    """The engine's parser: an explicit shape without --swiglu is still SwiGLU (as before), GPT-style values are
    refused by the flags' choices, and a GPT-style preset by name."""
    assert parse_args(GPT_FLAGS.replace(" --bf16", " --ffn-hidden-size 512").split()).model.llama_style
    with pytest.raises(ConfigError, match="normalization"):
        parse_args((GPT_FLAGS + " --ffn-hidden-size 512 --normalization LayerNorm").split())
    with pytest.raises(ConfigError, match="gpt3-175b is a GPT-style model"):
        parse_args("--model gpt3-175b".split())


def test_the_flavour_round_trips_through_the_manifest_and_old_manifests_read_as_llama():
    cfg = simulated(GPT3)
    again = RunConfig.from_dict(cfg.to_dict())
    assert again.model == cfg.model
    old = cfg.to_dict()
    for key in ("swiglu", "add_bias_linear", "normalization", "position_embedding_type"):
        del old["model"][key]
    assert RunConfig.from_dict(old).model.llama_style


def test_the_engine_refuses_the_gpt_style():
    torch = pytest.importorskip("torch")
    from engine.models.gpt_model import GPTModel
    from engine.parallel_state import ParallelState

    state = ParallelState(rank=0, world_size=1, tp_size=1, pp_size=1, dp_size=1, cp_size=1, tp_rank=0, pp_rank=0,
                          dp_rank=0, cp_rank=0)
    with pytest.raises(ConfigError, match="swiglu=False"):
        GPTModel(simulated(GPT_FLAGS).model, state, pre_process=True, post_process=True, layer_numbers=[0],
                 sequence_parallel=False, params_dtype=torch.float32, device="cpu")


# ---- FLOPs ---------------------------------------------------------------------------------------------------------

def megatron_num_floating_point_operations(cfg: RunConfig) -> float:
    """Megatron-LM's num_floating_point_operations (megatron/training/training.py) for a dense model, written out
    here as Megatron writes it: megatron-core 0.16.1 (the test extra) does not ship megatron.training, so the function
    cannot be imported. expansion 3 x 2 x 2; attention (1 + kv/heads + s/h/2 causal) x q/h; MLP f/h x the gated
    multiplier (3/2 with --swiglu, 1 without); logit V / (2 L h)."""
    m, t = cfg.model, cfg.train
    padded = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by,
                                      cfg.parallel.tensor_model_parallel_size)
    q_ratio = m.num_attention_heads * m.head_dim / m.hidden_size
    gated = 3 / 2 if m.swiglu else 1
    return (12 * t.global_batch_size * m.seq_length * m.num_layers * m.hidden_size ** 2
            * ((1 + m.num_query_groups / m.num_attention_heads + m.seq_length / m.hidden_size / 2) * q_ratio
               + m.ffn_hidden_size / m.hidden_size * gated
               + padded / (2 * m.num_layers * m.hidden_size)))


@pytest.mark.parametrize("flags", [GPT3, "--model llama3.1-8b --global-batch-size 64"], ids=["gpt3-gelu", "swiglu"])
def test_megatron_flops_match_megatrons_function(flags):
    cfg = simulated(flags)
    assert flops.megatron_flops_per_step(cfg) == pytest.approx(megatron_num_floating_point_operations(cfg), rel=1e-12)


def test_gpt3_flops_per_token_by_hand():
    """GeLU: the MLP is two f x h GEMMs, 8 h^2 weights with f = 4h, the attention projections 4 h^2: 12 h^2 weights
    a layer, x 2 (FMA) x 3 (forward and two backward GEMMs) = 72 L h^2 per token; causal attention 6 s L h; the
    logit GEMM 6 h V. PaLM's 6N takes N without the two lookup tables (word and position; tied, the word table is
    the logit GEMM's weight and stays)."""
    cfg = simulated(GPT3)
    per_token = 72 * L * H * H + 6 * SEQ * L * H + 6 * H * 50304
    assert flops.megatron_flops_per_step(cfg) == per_token * 1536 * SEQ
    assert flops.palm_flops_per_token(cfg) == 6 * (174_604_836_864 - SEQ * H) + 12 * L * H * SEQ


# ---- activations ---------------------------------------------------------------------------------------------------

def test_the_gelu_mlp_saves_fc1_output_and_fc2_input():
    """Megatron's MLP with bias_gelu_impl: GeLUFunction saves its input (fc1's output, f wide; the bias is a
    parameter) and linear_fc2 saves the GeLU's output: 2 a sbf where SwiGLU saves 3 a sbf (its fc1 output is 2f)."""
    gelu = simulated(LLAMA_FLAGS + " --ffn-hidden-size 1024")
    gelu = with_model(gelu, swiglu=False)
    swiglu = with_model(gelu, swiglu=True)
    a, s, b, f = 2, 64, 1, 1024
    saved = activations.layer_saved_tensors(gelu)
    assert saved["gelu.input=linear_fc1.output"] == saved["linear_fc2.input"] == a * s * b * f
    assert activations.layer_bytes(swiglu) - activations.layer_bytes(gelu) == a * s * b * f


def test_layernorm_saves_a_mean_per_token_and_learned_positions_their_ids():
    rms = simulated(LLAMA_FLAGS + " --ffn-hidden-size 1024")
    s, b = 64, 1
    assert activations.layer_bytes(with_model(rms, normalization="LayerNorm")) - activations.layer_bytes(rms) == \
        2 * 4 * s * b  # an fp32 mean beside rstd, two norms a layer
    assert activations.last_stage_extra_bytes(with_model(rms, normalization="LayerNorm")) - \
        activations.last_stage_extra_bytes(rms) == 4 * s * b  # the final norm's
    learned = with_model(rms, position_embedding_type="learned_absolute")
    assert activations.first_stage_extra_bytes(learned) == 2 * activations.first_stage_extra_bytes(rms) == 2 * 8 * s * b
    assert activations.layer_bytes(with_model(rms, add_bias_linear=True)) == activations.layer_bytes(rms)


# ---- communication and the time model's ops ------------------------------------------------------------------------

def test_sequence_parallel_all_reduces_the_norms_and_row_biases_not_the_column_biases():
    """Megatron marks LayerNorm weights and biases and the row-parallel linears' biases `sequence_parallel`; the QKV
    and fc1 biases are split over TP with their outputs, like their weights."""
    cfg = simulated(GPT_FLAGS + " --world-size 2 --tensor-model-parallel-size 2 --sequence-parallel")
    h, layers = 256, 4
    expected = layers * (2 * 2 * h + 2 * h) + 2 * h  # two LayerNorms (w + b), proj and fc2 biases; final LayerNorm
    (norm_grads,) = [c for name, c in comm.tp_collectives(cfg, 0).items() if "norm_grads" in name]
    assert norm_grads.size_bytes == expected * 4  # fp32 grads under --bf16


def test_learned_positions_under_sp_all_reduce_the_embedding_instead_of_reduce_scattering():
    """Megatron's LanguageModelEmbedding turns reduce_scatter_embeddings off when it adds position embeddings: the
    word embedding is all-reduced, the sum split; backward the split's conjugate all-gathers (as before)."""
    base = LLAMA_FLAGS + " --ffn-hidden-size 1024 --world-size 2 --tensor-model-parallel-size 2 --sequence-parallel"
    rope = simulated(base)
    learned = with_model(rope, position_embedding_type="learned_absolute")
    r = {name: x.calls for name, x in comm.tp_collectives(rope, 0).items()}
    g = {name: x.calls for name, x in comm.tp_collectives(learned, 0).items()}
    assert g["tp.reduce_scatter.activations[bf16]"] == r["tp.reduce_scatter.activations[bf16]"] - 1
    assert g["tp.all_reduce.activations[bf16]"] == 1
    assert g["tp.all_gather.activations[bf16]"] == r["tp.all_gather.activations[bf16]"]
    forward = [w.op.kind for w in ops.chunk_forward(learned, 0, 0)[:2] if isinstance(w.op, ops.Collective)]
    assert forward == ["all_reduce"]


def test_the_time_models_gpt_layer_runs_fc1_f_wide_gelu_layer_norm_and_no_rope():
    cfg = simulated(GPT_FLAGS)
    names = {k.name: dict(k.dims) for k in ops.kernels(cfg, 0)}
    assert names["linear_fc1.fprop"]["n"] == 1024 and names["gelu.fwd"] == {"tokens": 64, "width": 1024}
    assert {"gelu.bwd", "layer_norm.fwd", "layer_norm.bwd"} <= set(names)
    assert not {n for n in names if n.startswith(("swiglu", "rope", "rms_norm"))}


def test_every_gpt_parameter_has_its_forward_and_backward_marks():
    """The DP buckets are issued when their parameters' grads are final and gathered before first use: the
    biases and the position table ride with their weights."""
    cfg = simulated(GPT_FLAGS + " --pipeline-model-parallel-size 2 --world-size 2")
    for stage in (0, 1):
        names = {t.name for t in params.chunk_tensors(cfg, stage, 0)}
        for work in (ops.chunk_forward(cfg, stage, 0), ops.chunk_backward(cfg, stage, 0)):
            assert names <= {name for w in work for name in w.params}


@pytest.mark.parametrize("sp", ["", " --sequence-parallel"], ids=["tp", "tp-sp"])
def test_the_time_models_tp_collectives_are_comms_counts_for_the_gpt_layer(sp):
    """ops.py's passes and comm.py's per-step counts are two derivations of one thing: every [s, b, h] collective of
    a micro-batch, times the micro-batches, is the step's count (the loss's fp32 all-reduces apart)."""
    cfg = simulated(GPT_FLAGS + " --world-size 4 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
                    "--global-batch-size 8" + sp)
    m = cfg.num_microbatches
    for stage in (0, 1):
        counted: dict[str, int] = {}
        for work in (ops.chunk_forward(cfg, stage, 0), ops.chunk_backward(cfg, stage, 0)):
            for w in work:
                if isinstance(w.op, ops.Collective) and w.op.size_bytes != 4 * 64:  # not the loss's
                    counted[w.op.kind] = counted.get(w.op.kind, 0) + 1
        expected = {name.split(".")[1]: c.calls // m for name, c in comm.tp_collectives(cfg, stage).items()
                    if name.endswith(".activations[bf16]")}
        assert counted == expected
