"""The analytic formulas, held against the reference run's figures, Megatron-LM's published table and hand
derivations.

Every expected number is derived here from the shape, not copied from the code under test.
"""
from __future__ import annotations

import math

import pytest

from common.arguments import parse_args
from common.config import RecomputeConfig, RunConfig
from common.errors import ConfigError
from common.ops.sizes import padded_vocab_size
from ledger.models.formulas import activations, bubble, comm, flops, nccl_bw, params, peak_memory
from ledger.models.formulas.buffer_layout import (
    ParamTensor,
    layout_buffer,
    megatron_bucket_size,
    shard_param_elements,
)
from ledger.models.formulas.bytes_per_param import bytes_per_param
from ledger.models.formulas.static_memory import static_bytes

# The reference run (docs/engine.md): llama3.2-1b shape on 8 GPUs, TP2 x PP2 x DP2, SP, ZeRO-1, bf16, untied as
# runs/megatron/run.sh passes --untie-embeddings-and-output-weights.
REFERENCE = ("--model llama3.2-1b --world-size 8 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
        "--sequence-parallel --use-distributed-optimizer --overlap-grad-reduce --seq-length 8192 "
        "--max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 16 --bf16 "
        "--untie-embeddings-and-output-weights")
TIED_REFERENCE = REFERENCE.replace(" --untie-embeddings-and-output-weights", "")
NO_TP_REFERENCE = (REFERENCE.replace("--world-size 8 --tensor-model-parallel-size 2", "--world-size 4")
              .replace(" --sequence-parallel", ""))
L, H, F, NQ, NKV, V = 16, 2048, 8192, 32, 8, 128256
D = H // NQ


def cfg(flags: str):
    return parse_args(flags.split())


# ---- parameters ---------------------------------------------------------------------------------------------------

def test_reference_parameter_counts():
    attention = 2 * H * H + 2 * H * (NKV * D)        # q and o are h x h, k and v are h x n_kv d
    mlp = 3 * H * F                                   # gate, up, down
    per_layer = attention + mlp + 2 * H               # two RMSNorm weights
    c = cfg(REFERENCE)
    assert per_layer == 60_821_504 == params.params_per_layer(c.model)
    assert L * per_layer == 973_144_064
    assert params.component_counts(c.model, 2)["embedding"] == V * H == 262_668_288
    assert params.component_counts(c.model, 2)["output_layer"] == 262_668_288
    assert params.params_total(c) == L * per_layer + 2 * V * H + H == 1_498_482_688


def test_llama32_1b_ties_by_default_as_the_real_model():
    # Llama-3.2-1B shares its input embedding with the output layer: the vocabulary matrix counts once.
    per_layer = 2 * H * H + 2 * H * (NKV * D) + 3 * H * F + 2 * H
    tied, untied = cfg("--model llama3.2-1b"), cfg("--model llama3.2-1b --untie-embeddings-and-output-weights")
    assert params.params_total(tied) == L * per_layer + V * H + H == 1_235_814_400
    assert params.params_total(untied) == L * per_layer + 2 * V * H + H == 1_498_482_688
    assert params.component_counts(tied.model)["output_layer"] == 0
    assert params.component_counts(untied.model)["output_layer"] == V * H


def test_a_manifest_from_before_the_flag_reads_as_untied():
    # The engine untied always before --untie-embeddings-and-output-weights existed; its manifests lack the field.
    tied = cfg("--model llama3.2-1b")
    old = tied.to_dict()
    del old["model"]["untie_embeddings_and_output_weights"]
    assert RunConfig.from_dict(old).model.untie_embeddings_and_output_weights
    assert RunConfig.from_dict(tied.to_dict()) == tied


def test_tied_embeddings_register_no_output_weight_on_one_stage_and_a_copy_under_pp():
    one = cfg("--model tiny")
    assert [t.name for t in params.chunk_tensors(one, 0, 0)][-1] == "decoder.final_layernorm.weight"
    assert not any(t.shared_embedding for t in params.chunk_tensors(one, 0, 0))
    c = cfg("--model tiny --world-size 2 --pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2 "
            "--global-batch-size 2")
    first, last = params.chunk_tensors(c, 0, 0), params.chunk_tensors(c, 1, 1)
    assert (first[0].name, first[0].shared_embedding) == ("embedding.word_embeddings.weight", True)
    assert (last[-1].name, last[-1].shape, last[-1].shared_embedding) == ("output_layer.weight", (1000, 64), True)
    assert [t.shared_embedding for t in params.chunk_tensors(c, 0, 1) + params.chunk_tensors(c, 1, 0)] == [False] * 12
    # The model has one vocabulary matrix; the stages together hold two.
    h, vocab = 64, 1000
    assert sum(params.params_per_stage(c)) == params.params_total(c) + vocab * h
    assert params.params_per_rank(c, 1) == params.params_per_rank(c, 0) + h  # + final norm, copy for embedding


def test_reference_parameters_per_stage_and_per_card():
    c = cfg(REFERENCE)
    per_layer_matrices = 60_821_504 - 2 * H
    stage0 = 8 * 60_821_504 + V * H
    stage1 = 8 * 60_821_504 + H + V * H
    assert params.params_per_stage(c) == [stage0, stage1]
    assert round(stage0 / 1e6, 1) == round(stage1 / 1e6, 1) == 749.2
    card0 = 8 * (per_layer_matrices // 2 + 2 * H) + V * H // 2      # matrices split over TP, norms replicated
    card1 = 8 * (per_layer_matrices // 2 + 2 * H) + H + V * H // 2
    assert [params.params_per_rank(c, 0), params.params_per_rank(c, 1)] == [card0, card1]
    assert round(card1 / 1e6, 1) == 374.6


def test_vocab_padding_to_divisible_by_times_tp():
    assert padded_vocab_size(128256, 128, 2) == 128256          # 128256 = 256 x 501: no change at TP2
    assert padded_vocab_size(128256, 128, 4) == 251 * 512        # 250.5 multiples of 512 -> 251
    assert padded_vocab_size(1000, 8, 1) == 1000
    assert padded_vocab_size(1000, 8, 2) == 63 * 16              # ceil(1000 / 16) = 63


@pytest.mark.parametrize("untie, vocab_matrices", [("", 1), (" --untie-embeddings-and-output-weights", 2)])
def test_vocab_padding_changes_totals_only_when_it_pads(untie, vocab_matrices):
    base = "--model llama3.2-1b --micro-batch-size 1 --global-batch-size 8" + untie
    tp2 = cfg(f"{base} --world-size 2 --tensor-model-parallel-size 2")
    tp4 = cfg(f"{base} --world-size 4 --tensor-model-parallel-size 4")
    assert params.params_total(tp2) == L * 60_821_504 + vocab_matrices * V * H + H
    assert params.params_total(tp4) - params.params_total(tp2) == vocab_matrices * (251 * 512 - V) * H


def test_interleaved_chunks_hold_virtual_stages():
    c = cfg("--model tiny --world-size 2 --pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2 "
            "--global-batch-size 2")
    assert [list(params.chunk_layers(c, r, k)) for r in range(2) for k in range(2)] == [[0], [2], [1], [3]]
    names0 = [t.name for t in params.chunk_tensors(c, 0, 0)]
    assert names0[0] == "embedding.word_embeddings.weight" and names0[1] == "decoder.layers.0.input_layernorm.weight"
    assert [t.name for t in params.chunk_tensors(c, 1, 1)][-2:] == ["decoder.final_layernorm.weight",
                                                                    "output_layer.weight"]


# ---- bytes per parameter ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("d", [1, 2, 4, 8, 64])
def test_megatron_distributed_optimizer_table(d):
    # docs/user-guide/features/dist_optimizer.md: non-distributed | distributed, d = data-parallel size
    table = {("fp16", "fp16"): (20, 4 + 16 / d), ("bf16", "fp32"): (18, 6 + 12 / d), ("fp32", "fp32"): (16, 8 + 8 / d)}
    for (pdt, gdt), (ddp, zero1) in table.items():
        assert bytes_per_param(pdt, gdt, "ddp", d).total == ddp
        assert bytes_per_param(pdt, gdt, "zero1", d).total == pytest.approx(zero1)


def test_zero2_zero3_and_bf16_grads():
    # bf16 params 2, fp32 grads 4, fp32 master 4, Adam 8: ZeRO-2 shards the last three, ZeRO-3 all four
    assert bytes_per_param("bf16", "fp32", "zero2", 4).total == 2 + (4 + 4 + 8) / 4
    assert bytes_per_param("bf16", "fp32", "zero3", 4).total == (2 + 4 + 4 + 8) / 4
    # bf16 grads: the optimizer needs an fp32 copy of its grad shard, as in Megatron's fp16 row
    assert bytes_per_param("bf16", "bf16", "ddp", 2).total == 2 + 2 + 4 + 4 + 8
    assert bytes_per_param("bf16", "bf16", "zero1", 2).total == 2 + 2 + (4 + 4 + 8) / 2


def test_after_optimizer_init_lacks_adam_moments():
    for d in (1, 2, 8):
        stepped = bytes_per_param("bf16", "fp32", "zero1", d).total
        init = bytes_per_param("bf16", "fp32", "zero1", d, "after_optimizer_init").total
        assert stepped - init == pytest.approx(8 / d)


def test_unknown_strategy_is_a_config_error():
    with pytest.raises(ConfigError):
        bytes_per_param("bf16", "fp32", "zero4", 2)


# ---- buffer layout and static memory ------------------------------------------------------------------------------

def _abc():
    return [ParamTensor("a", (100,)), ParamTensor("b", (30,)), ParamTensor("c", (20, 10))]


def test_layout_with_distributed_optimizer_pads_params_and_buckets():
    lay = layout_buffer(_abc(), bucket_size=150, dp=2, distributed_optimizer=True)
    # reverse order: c [0, 200) reaches 150 -> bucket 0 ends at 200 rounded up to lcm(2, 128) = 128 -> 256;
    # b [256, 286); a starts at 286 rounded up to 64 -> 320, ends 420: 420 - 256 >= 150 -> bucket 1 ends at 512
    assert lay.param_ranges == {"c": (0, 200, 0), "b": (256, 286, 1), "a": (320, 420, 1)}
    assert lay.buckets == [(0, 256), (256, 512)]
    assert (lay.numel, lay.numel_unpadded, lay.padding) == (512, 330, 182)
    # each bucket splits in two: rank 0 owns [0,128) and [256,384), rank 1 owns [128,256) and [384,512)
    assert shard_param_elements(lay, 2, 0) == 128 + 30 + (384 - 320)
    assert shard_param_elements(lay, 2, 1) == (200 - 128) + (420 - 384)


def test_layout_without_distributed_optimizer_is_unpadded():
    lay = layout_buffer(_abc(), bucket_size=150, dp=2, distributed_optimizer=False)
    assert lay.param_ranges == {"c": (0, 200, 0), "b": (200, 230, 1), "a": (230, 330, 1)}
    assert lay.buckets == [(0, 200), (200, 330)] and lay.padding == 0


def test_layout_single_bucket_and_large_dp_alignment():
    lay = layout_buffer(_abc(), bucket_size=None, dp=256, distributed_optimizer=True)
    assert lay.param_ranges["a"] == (320, 420, 0)        # c [0,200), b [256,286), a at 320
    assert lay.buckets == [(0, 512)]                     # lcm(256, 128) = 256


def test_shared_embedding_gets_a_bucket_of_its_own_under_the_distributed_optimizer():
    # a (100) is the shared embedding, registered first: laid out last. c [0, 200), b [256, 286); a would start at
    # 320 (64-aligned), but the open bucket closes there (padded to 384 = 3 x lcm(2, 128)) and a gets [384, 484),
    # its bucket padded to 512. Every DP rank then owns the same elements of it as of the other stage's copy.
    shared = [ParamTensor("a", (100,), shared_embedding=True), ParamTensor("b", (30,)), ParamTensor("c", (20, 10))]
    lay = layout_buffer(shared, bucket_size=None, dp=2, distributed_optimizer=True)
    assert lay.param_ranges == {"c": (0, 200, 0), "b": (256, 286, 0), "a": (384, 484, 1)}
    assert lay.buckets == [(0, 384), (384, 512)]
    copy_first = layout_buffer(shared[::-1], bucket_size=None, dp=2, distributed_optimizer=True)
    assert copy_first.param_ranges["a"] == (0, 100, 0) and copy_first.buckets[0] == (0, 128)
    # Without the distributed optimizer nothing is sharded: no bucket of its own, no padding.
    assert layout_buffer(shared, None, 2, False).buckets == [(0, 330)]


def test_megatron_bucket_size_rule():
    flags = "--model tiny --world-size 128 --pipeline-model-parallel-size 2 --global-batch-size 64"
    assert megatron_bucket_size(cfg(flags), 0, 0) is None                          # no --overlap-grad-reduce
    c = cfg(flags + " --overlap-grad-reduce")
    assert megatron_bucket_size(c, 0, 0) == max(40_000_000, 1_000_000 * 64)
    assert megatron_bucket_size(c, 1, 0) is None                                   # pipeline ranks > 0
    assert megatron_bucket_size(cfg(flags + " --overlap-grad-reduce --ddp-bucket-size 1000"), 0, 0) == 1000


def test_static_bytes_to_the_byte_depend_on_dp_rank():
    c = cfg("--model tiny --world-size 2 --bf16 --use-distributed-optimizer --untie-embeddings-and-output-weights")
    n = 4 * (64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 176 + 2 * 64) + 2 * 1000 * 64 + 64
    assert n == 312_896
    numel = math.ceil(n / 128) * 128                   # every tensor is a multiple of 64; one bucket padded to 128
    owned = [numel // 2, n - numel // 2]
    for dp_rank in (0, 1):
        s = static_bytes(c, 0, 0, dp_rank)
        assert (s.param_buffer, s.grad_buffer, s.padding) == (2 * numel, 4 * numel, 6 * (numel - n))
        assert (s.master_params, s.adam_m, s.adam_v, s.grad_fp32_copy) == (4 * owned[dp_rank],) * 3 + (0,)
        init = static_bytes(c, 0, 0, dp_rank, "after_optimizer_init")
        assert s.total - init.total == 8 * owned[dp_rank]


def test_reference_static_bytes_per_card():
    c = cfg(REFERENCE)
    card = params.params_per_rank(c, 1)
    assert bytes_per_param("bf16", "fp32", "zero1", 2).total == 12
    s = static_bytes(c, 1, 1, 1)
    assert s.padding == 0                 # every llama tensor is a multiple of 64, every buffer of 128
    assert s.total == 12 * card
    assert round(s.total / 1e9, 2) == 4.50 and round(s.total / 2 ** 30, 2) == 4.19


def test_rank_out_of_range_is_a_config_error():
    with pytest.raises(ConfigError):
        static_bytes(cfg(REFERENCE), 0, 2, 0)


# ---- activations --------------------------------------------------------------------------------------------------

def _korthikanti_layer_bytes(s, b, h, heads, tp, sequence_parallel):
    """The paper's formula (Korthikanti et al. 2022, Table 2), 16-bit activations with dropout and unfused softmax
    attention: sbh(34 + 5as/h); TP: sbh(10 + 24/t + 5as/(ht)); TP + SP: sbh(34/t + 5as/(ht))."""
    quadratic = 5 * heads * s / (h * tp)
    if sequence_parallel:
        return s * b * h * (34 / tp + quadratic)
    return s * b * h * (10 + 24 / tp + quadratic)


def _korthikanti_gap(s, b, h, f, nq, t, sp):
    """Ours = Korthikanti - attention-score terms (flash) - dropout masks + SwiGLU's wider fc1 output + fp32 small."""
    div = t if sp else 1
    return (-5 * nq * s * s * b / t - 2 * s * b * h / div + 2 * s * b * f / t
            + 8 * s * b / div + 4 * nq * s * b / t)


@pytest.mark.parametrize("t,sp", [(1, False), (2, False), (2, True), (4, True)])
def test_layer_activations_against_korthikanti(t, sp):
    # MHA so that the attention tensors match the paper's; bf16; f = 4h as in the paper
    s, b, h, nq = 256, 2, 512, 8
    f = 4 * h
    c = cfg(f"--num-layers 4 --hidden-size {h} --ffn-hidden-size {f} --num-attention-heads {nq} --vocab-size 1000 "
            f"--seq-length {s} --micro-batch-size {b} --world-size {t} --tensor-model-parallel-size {t} --bf16"
            + (" --sequence-parallel" if sp else ""))
    expected = _korthikanti_layer_bytes(s, b, h, nq, t, sp) + _korthikanti_gap(s, b, h, f, nq, t, sp)
    assert activations.layer_bytes(c) == pytest.approx(expected, rel=1e-12)


def test_reference_layer_activations_gqa_swiglu():
    c = cfg(NO_TP_REFERENCE)
    s, b, r = 8192, 1, NKV / NQ
    sbh = s * b * H
    # bf16: 6 [s,b,h] tensors (2 norm inputs, qkv and fc1 inputs, q, attention output) + k and v at n_kv/n_q width,
    # fc1 output (2f) and fc2 input (f); fp32 rstd x2 and logsumexp per head
    expected = 2 * sbh * (6 + 2 * r) + 2 * s * b * 3 * F + 2 * 4 * s * b + 4 * NQ * s * b
    assert activations.layer_bytes(c) == expected
    assert 2 * sbh * (6 + 2 * r) + 2 * s * b * 3 * F == 37 * sbh


def test_sequence_parallel_divides_everything_by_t():
    c_sp = cfg(REFERENCE)
    c_1 = cfg(NO_TP_REFERENCE)
    assert activations.layer_bytes(c_sp) * 2 == activations.layer_bytes(c_1)


def test_in_flight_microbatches_1f1b_and_interleaved():
    def c(p, m, v=None):
        vflag = f" --virtual-pipeline-model-parallel-size {v}" if v else ""
        return cfg(f"--model tiny --num-layers 8 --world-size {p} --pipeline-model-parallel-size {p}"
                   f" --global-batch-size {m}" + vflag)
    assert [activations.in_flight(c(4, 8), i) for i in range(4)] == [4, 3, 2, 1]     # min(p - i, m)
    assert [activations.in_flight(c(4, 2), i) for i in range(4)] == [2, 2, 2, 1]
    p, v, layers = 2, 2, 8
    inter = c(p, 8, v)
    # stage 0 holds Megatron's (1 + (p-1)/(p v)) x p micro-batches' worth of its L/p layers
    held_layers = activations.in_flight(inter, 0) * layers // (p * v)
    assert held_layers == (1 + (p - 1) / (p * v)) * p * layers / p


def _with(c, granularity, method=None, layers=None):
    return activations.with_recompute(c, RecomputeConfig(granularity, method, layers))


def test_full_recompute_keeps_group_inputs_and_rebuilds_one_group():
    # Stage 0 of the reference run: 8 layers, two micro-batches in flight, SP; I = a layer's input, B = a layer's saved
    # set.
    c = cfg(REFERENCE)
    s, b, t = 8192, 1, 2
    i, layer = 2 * s * b * H // t, activations.layer_bytes(c)
    tokens = 2 * 8 * s * b
    assert activations.stage_activation_bytes(c, 0) == 2 * 8 * layer + tokens
    # uniform 1: 8 inputs per micro-batch; the oldest's backward rebuilds layer 7 while layers 0-6 keep their inputs
    assert activations.stage_activation_bytes(_with(c, "full", "uniform", 1), 0) == 8 * i + (7 * i + layer) + tokens
    # uniform 3 cuts 8 layers into 3 + 3 + 2: 3 inputs; the peak rebuilds a group of 3 with one earlier input held
    assert activations.stage_activation_bytes(_with(c, "full", "uniform", 3), 0) == 3 * i + (i + 3 * layer) + tokens
    # block 2: 2 inputs + 6 whole layers; rebuilding layer 1 (with layer 0's input) comes after 6 layers were freed
    assert activations.stage_activation_bytes(_with(c, "full", "block", 2), 0) == 2 * (2 * i + 6 * layer) + tokens
    # block over every layer (or more, as Megatron accepts) is uniform 1
    for n in (8, 20):
        assert (activations.stage_activation_bytes(_with(c, "full", "block", n), 0)
                == activations.stage_activation_bytes(_with(c, "full", "uniform", 1), 0))


def test_the_last_stage_frees_its_loss_tensors_before_the_decoder_backward():
    # Stage 1, one micro-batch in flight: after the forward it holds one input + the loss side (fp32 softmax of the
    # 128256-word vocabulary); rebuilding all 8 layers at once (uniform 8) is larger, and is the peak on its own.
    c = _with(cfg(REFERENCE), "full", "uniform", 8)
    s, b, t = 8192, 1, 2
    i, layer = 2 * s * b * H // t, activations.layer_bytes(c)
    loss_side = 2 * 2 * s * b * H // t + 4 * s * b // t + 4 * s * b * V // t + 9 * s * b
    assert 8 * layer > i + loss_side
    assert activations.stage_activation_bytes(c, 1) == 8 * layer


FUSED_LOSS = " --cross-entropy-loss-fusion --cross-entropy-fusion-impl linear"


@pytest.mark.parametrize("flags, tokens, t", [
    ("--model llama3.2-1b --seq-length 4096 --micro-batch-size 1 --global-batch-size 8 --bf16", 4096, 1),
    (REFERENCE, 8192, 2),  # the last stage at TP2 + SP: the vocabulary and the token shards are each split by t
    ("--model tiny --seq-length 32 --micro-batch-size 2 --global-batch-size 2 --bf16", 64, 1),  # one short chunk
])
def test_the_fused_loss_holds_one_chunk_of_logits_instead_of_the_micro_batchs(flags, tokens, t):
    """Unfused, this engine's loss saves the 16-bit logits a sb V/t and two fp32 figures per token (the max and the
    sum of exponentials) beside its targets, and its backward writes their gradient, a sb V/t more; fused over chunks
    of C = min(1024, sb) tokens it keeps the two figures and, while its backward runs, one chunk's logits and their
    gradient, 2 a C V/t; nothing else changes."""
    unfused, fused = cfg(flags), cfg(flags + FUSED_LOSS)
    m = unfused.model
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, t)
    chunk = min(1024, tokens)
    assert activations.loss_chunk_tokens(fused) == chunk
    assert activations.loss_saved_bytes(unfused) == 2 * tokens * vocab // t + 8 * tokens + 9 * tokens
    assert activations.loss_saved_bytes(fused) == 2 * 2 * chunk * vocab // t + 8 * tokens + 9 * tokens
    assert (activations.last_stage_extra_bytes(unfused) - activations.last_stage_extra_bytes(fused)
            == activations.loss_saved_bytes(unfused) - activations.loss_saved_bytes(fused))
    assert activations.logits_transient_bytes(unfused) == 2 * tokens * vocab // t
    assert activations.logits_transient_bytes(fused) == 0
    assert activations.layer_bytes(fused) == activations.layer_bytes(unfused)


@pytest.mark.parametrize("flags, tokens, t", [
    ("--model llama3.2-1b --seq-length 4096 --micro-batch-size 1 --global-batch-size 8 --bf16", 4096, 1),
    (REFERENCE, 8192, 2),
])
def test_the_loss_backward_sets_the_peak_of_long_sequences_with_or_without_fusion(flags, tokens, t):
    """At 4096-8192 tokens the logits outweigh the output weight (s > h here): the unfused last stage peaks in the
    loss's backward, its gradient beside the logits it saved (2 a sb V/t above what the rest saves); fused, in the
    one backward of the output layer and loss, the chunk's logits and gradient beside the layer's input gradient
    [s, b, h] (its dL/dW added into main_grad). The fused peak is lower by the difference."""
    unfused, fused = cfg(flags), cfg(flags + FUSED_LOSS)
    m, a = unfused.model, 2
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, t)
    last = unfused.parallel.pipeline_model_parallel_size - 1
    peak, fused_peak = peak_memory.stage_peaks(unfused)[last], peak_memory.stage_peaks(fused)[last]
    assert peak.phase.name == "loss backward"
    assert fused_peak.phase.name == "fused output layer and loss backward"
    unfused_loss = 2 * a * tokens * vocab // t + 8 * tokens
    fused_loss = 2 * a * min(1024, tokens) * vocab // t + 8 * tokens + a * tokens * m.hidden_size
    assert peak.total - fused_peak.total == unfused_loss - fused_loss


def test_llama_1b_at_4096_tokens_sheds_about_a_gib_and_a_half_of_peak():
    """The issue's shape: 2 GiB of logits and their gradient at the loss's backward become 0.49 GiB of one 1024-token
    chunk's and the 16 MiB input gradient beside them: 1.45 GiB off the peak. Measured on the H200 (the 2026-12-02
    Engine VII call, the untied preset, side by side): 1,558,184,960 B, which the phases give within 0.1%."""
    flags = "--model llama3.2-1b --seq-length 4096 --micro-batch-size 1 --global-batch-size 8 --bf16"
    saved = peak_memory.stage_peaks(cfg(flags))[0].total - peak_memory.stage_peaks(cfg(flags + FUSED_LOSS))[0].total
    assert saved == (4 * 4096 - 4 * 1024) * V - 2 * 4096 * 2048
    assert saved == pytest.approx(1_558_184_960, rel=1e-3)
    assert round(saved / 2**30, 2) == 1.45


def test_selective_recompute_frees_only_the_logsumexp():
    c = cfg(REFERENCE)
    selective = _with(c, "selective")
    assert "attention.logsumexp" not in activations.layer_saved_tensors(selective)
    assert activations.layer_bytes(c) - activations.layer_bytes(selective) == 4 * 1 * (NQ // 2) * 8192
    assert activations.recompute_label(selective.recompute) == "selective"


# ---- bubble -------------------------------------------------------------------------------------------------------

def test_reference_bubble():
    c = cfg(REFERENCE)
    assert c.num_microbatches == 16 // (1 * 2) == 8
    b = bubble.bubble(2, c.num_microbatches)
    assert b.of_wall_time == pytest.approx(1 / 9) and round(b.of_wall_time, 2) == 0.11
    assert b.relative_to_compute == pytest.approx(1 / 8)


def test_interleaved_bubble():
    b = bubble.bubble(4, 8, 2)
    assert b.relative_to_compute == pytest.approx(3 / 16)
    assert b.of_wall_time == pytest.approx(3 / (16 + 3))


# ---- communication ------------------------------------------------------------------------------------------------

def test_nccl_bus_factors():
    assert nccl_bw.bus_factor("all_reduce", 8) == 2 * 7 / 8
    assert nccl_bw.bus_factor("all_gather", 8) == nccl_bw.bus_factor("reduce_scatter", 8) == 7 / 8
    assert nccl_bw.bus_factor("send_recv", 2) == 1
    assert nccl_bw.algbw(1e9, 0.01) == pytest.approx(1e11)
    assert nccl_bw.busbw(1e9, 0.01, "all_reduce", 8) == pytest.approx(1e11 * 1.75)


def test_dp_collectives_ddp_vs_distributed_optimizer():
    ddp = cfg("--model tiny --world-size 4")
    n = params.params_total(ddp)
    ar = comm.step_collectives(ddp, 0)["dp.all_reduce.grads[fp32]"]
    assert ar.size_bytes == 4 * n and ar.bytes_per_rank == 4 * n * 2 * 3 / 4
    zero = cfg("--model tiny --world-size 4 --bf16 --use-distributed-optimizer")
    numel = math.ceil(n / 128) * 128
    col = comm.step_collectives(zero, 0)
    assert col["dp.reduce_scatter.grads[fp32]"].bytes_per_rank == 4 * numel * 3 / 4
    assert col["dp.all_gather.params[bf16]"].bytes_per_rank == 2 * numel * 3 / 4


@pytest.mark.parametrize("sp", [False, True])
def test_tp_collectives_with_and_without_sp(sp):
    s, b, h, layers, m, t = 32, 1, 64, 4, 2, 2
    c = cfg(f"--model tiny --world-size {t} --tensor-model-parallel-size {t} --global-batch-size {m} --bf16"
            + (" --sequence-parallel" if sp else ""))
    msg = 2 * s * b * h
    col = comm.step_collectives(c, 0)
    if sp:   # per layer 6 AG + 4 RS; embedding RS + AG; output layer AG + RS + AG
        assert col["tp.all_gather.activations[bf16]"].size_bytes == m * (6 * layers + 1 + 2) * msg
        assert col["tp.reduce_scatter.activations[bf16]"].size_bytes == m * (4 * layers + 1 + 1) * msg
        assert col["tp.all_reduce.norm_grads[fp32]"].size_bytes == 4 * (2 * h * layers + h)
    else:    # per layer 4 AR; embedding forward AR; output layer backward AR
        assert col["tp.all_reduce.activations[bf16]"].size_bytes == m * (4 * layers + 2) * msg
    assert col["tp.all_reduce.cross_entropy[fp32]"].size_bytes == m * 3 * 4 * s * b
    assert not [name for name in col if "recompute" in name]


@pytest.mark.parametrize("sp", [False, True])
@pytest.mark.parametrize("recompute, groups", [(("full", "uniform", 3), [3, 1]), (("full", "block", 1), [1]),
                                               (("selective", None, None), [])])
def test_recompute_repeats_the_forward_collectives_of_each_checkpointed_group(sp, recompute, groups):
    # Backward re-runs a group's forward up to its last saved tensor (fc2's input): per layer the all-gathers before
    # QKV and fc1 (SP) and the proj / fc2 output collectives, but not the group's last fc2 output collective.
    s, b, h, m, t = 32, 1, 64, 2, 2
    c = cfg(f"--model tiny --world-size {t} --tensor-model-parallel-size {t} --global-batch-size {m} --bf16"
            + (" --sequence-parallel" if sp else ""))
    col = comm.step_collectives(_with(c, *recompute), 0)
    msg = 2 * s * b * h
    repeated = {k: v.size_bytes for k, v in col.items() if "recompute" in k}
    layers = sum(groups)
    if not groups:
        assert repeated == {}
    elif sp:
        assert repeated == {"tp.all_gather.recompute[bf16]": m * 2 * layers * msg,
                            "tp.reduce_scatter.recompute[bf16]": m * (2 * layers - len(groups)) * msg}
    else:
        assert repeated == {"tp.all_reduce.recompute[bf16]": m * (2 * layers - len(groups)) * msg}


@pytest.mark.parametrize("flags, stages", [
    ("--world-size 8 --pipeline-model-parallel-size 4 --tensor-model-parallel-size 2", (0, 3)),
    ("--world-size 4 --pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2", (0, 1))])
def test_tied_embeddings_all_reduce_their_grads_once_per_step_on_both_ends(flags, stages):
    c = cfg(f"--model tiny --global-batch-size 4 --bf16 {flags}")
    pp, tp = c.parallel.pipeline_model_parallel_size, c.parallel.tensor_model_parallel_size
    vocab_shard = padded_vocab_size(1000, 8, tp) // tp
    for stage in range(pp):
        col = comm.step_collectives(c, stage).get("embedding.all_reduce.word_embedding_grads[fp32]")
        if stage in stages:  # this TP rank's vocab shard of the fp32 main grad, over the 2 ranks of the group
            assert (col.group_size, col.calls, col.size_bytes) == (2, 1, 4 * vocab_shard * 64)
            assert col.bytes_per_rank == col.size_bytes * 2 * (2 - 1) / 2
        else:
            assert col is None
    untied = cfg(f"--model tiny --global-batch-size 4 --bf16 {flags} --untie-embeddings-and-output-weights")
    assert not any(n.startswith("embedding.") for s in range(pp) for n in comm.step_collectives(untied, s))
    assert not any(n.startswith("embedding.") for n in comm.step_collectives(cfg("--model tiny"), 0))


def test_pp_sends_per_microbatch():
    c = cfg(REFERENCE)
    msg = 2 * 8192 * 1 * H // 2                     # [s/t, b, h] under SP
    for stage in (0, 1):
        assert comm.step_collectives(c, stage)["pp.send.activations_and_grads[bf16]"].size_bytes == 8 * msg
    inter = cfg("--model tiny --world-size 2 --pipeline-model-parallel-size 2 "
                "--virtual-pipeline-model-parallel-size 2 --global-batch-size 4")
    # rank 0 holds virtual stages 0 and 2 (0 sends forward; 2 forward and backward): 3 sends a micro-batch
    assert comm.step_collectives(inter, 0)["pp.send.activations_and_grads[fp32]"].calls == 3 * 4


# ---- FLOPs --------------------------------------------------------------------------------------------------------

def test_reference_megatron_flops():
    c = cfg(REFERENCE)
    B, s, q, kv = 16, 8192, NQ * D, NKV * D
    gemm_per_token = L * (H * (q + 2 * kv) + q * H + 3 * H * F) + H * V      # multiply-adds per token, forward
    attention_per_token = L * 2 * s * q / 2                                   # QK^T and PV, causal half
    expected = 3 * 2 * (gemm_per_token + attention_per_token) * B * s        # x2 FMA, x3 forward + 2 backward
    assert flops.megatron_flops_per_step(c) == expected


@pytest.mark.parametrize("flags", [
    REFERENCE, TIED_REFERENCE,
    "--model tiny --world-size 2 --tensor-model-parallel-size 2 --global-batch-size 8 --num-query-groups 2",
    "--model llama3.1-8b --world-size 4 --tensor-model-parallel-size 4 --global-batch-size 4",
    "--model mixtral-8x7b-2l --global-batch-size 8"])
def test_the_engines_throughput_counts_the_ledgers_flops(flags):
    """The engine's step log derives Megatron's FLOPs in its own (factored) form; the ledger's term-by-term count is the
    same number, held equal here rather than shared by import."""
    from engine.training import num_floating_point_operations

    c = cfg(flags)
    engine = num_floating_point_operations(c, c.train.global_batch_size)
    assert engine == pytest.approx(flops.megatron_flops_per_step(c), rel=1e-12)


def test_palm_flops_and_mfu():
    c = cfg(REFERENCE)
    n_non_embedding = 1_498_482_688 - V * H
    assert flops.palm_flops_per_token(c) == 6 * n_non_embedding + 12 * L * H * 8192
    # Tied, N = 1,235,814,400 holds the vocabulary matrix once, and it is the logit GEMM's weight: nothing is left
    # out, and the count is the untied one (Megatron's count does not depend on tying either).
    assert flops.palm_flops_per_token(cfg(TIED_REFERENCE)) == 6 * 1_235_814_400 + 12 * L * H * 8192
    assert flops.palm_flops_per_token(cfg(TIED_REFERENCE)) == flops.palm_flops_per_token(c)
    assert flops.megatron_flops_per_step(cfg(TIED_REFERENCE)) == flops.megatron_flops_per_step(c)
    assert flops.mfu(989e12 * 8 * 2.0, 2.0, 8) == pytest.approx(1.0)
    assert flops.mfu(1e15, 1.0, 1, peak_flops=2e15) == pytest.approx(0.5)
