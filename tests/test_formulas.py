"""The analytic formulas, held against the seed's worked example, Megatron-LM's published table and hand derivations.

Every expected number is derived here from the shape, not copied from the code under test.
"""
from __future__ import annotations

import math

import pytest

from common.arguments import parse_args
from common.errors import ConfigError
from ledger.formulas import activations, bubble, comm, flops, nccl_bw, params
from ledger.formulas.buffer_layout import ParamTensor, layout_buffer, megatron_bucket_size, shard_param_elements
from ledger.formulas.bytes_per_param import bytes_per_param
from ledger.formulas.static_memory import static_bytes

# The seed (000, chapters 1 and 4): llama3.2-1b shape on 8 GPUs, TP2 x PP2 x DP2, SP, ZeRO-1, bf16.
SEED = ("--model llama3.2-1b --world-size 8 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 "
        "--sequence-parallel --use-distributed-optimizer --overlap-grad-reduce --seq-length 8192 "
        "--max-position-embeddings 8192 --micro-batch-size 1 --global-batch-size 16 --bf16")
NO_TP_SEED = (SEED.replace("--world-size 8 --tensor-model-parallel-size 2", "--world-size 4")
              .replace(" --sequence-parallel", ""))
L, H, F, NQ, NKV, V = 16, 2048, 8192, 32, 8, 128256
D = H // NQ


def cfg(flags: str):
    return parse_args(flags.split())


# ---- parameters ---------------------------------------------------------------------------------------------------

def test_seed_parameter_counts():
    attention = 2 * H * H + 2 * H * (NKV * D)        # q and o are h x h, k and v are h x n_kv d
    mlp = 3 * H * F                                   # gate, up, down
    per_layer = attention + mlp + 2 * H               # two RMSNorm weights
    c = cfg(SEED)
    assert per_layer == 60_821_504 == params.params_per_layer(c.model)
    assert L * per_layer == 973_144_064
    assert params.component_counts(c.model, 2)["embedding"] == V * H == 262_668_288
    assert params.component_counts(c.model, 2)["output_layer"] == 262_668_288
    assert params.params_total(c) == L * per_layer + 2 * V * H + H == 1_498_482_688


def test_seed_parameters_per_stage_and_per_card():
    c = cfg(SEED)
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
    assert params.padded_vocab_size(128256, 128, 2) == 128256          # 128256 = 256 x 501: no change at TP2
    assert params.padded_vocab_size(128256, 128, 4) == 251 * 512        # 250.5 multiples of 512 -> 251
    assert params.padded_vocab_size(1000, 8, 1) == 1000
    assert params.padded_vocab_size(1000, 8, 2) == 63 * 16              # ceil(1000 / 16) = 63


def test_vocab_padding_changes_totals_only_when_it_pads():
    base = "--model llama3.2-1b --micro-batch-size 1 --global-batch-size 8"
    tp2 = cfg(f"{base} --world-size 2 --tensor-model-parallel-size 2")
    tp4 = cfg(f"{base} --world-size 4 --tensor-model-parallel-size 4")
    assert params.params_total(tp2) == 1_498_482_688
    assert params.params_total(tp4) - params.params_total(tp2) == 2 * (251 * 512 - V) * H


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


def test_megatron_bucket_size_rule():
    flags = "--model tiny --world-size 128 --pipeline-model-parallel-size 2 --global-batch-size 64"
    assert megatron_bucket_size(cfg(flags), 0, 0) is None                          # no --overlap-grad-reduce
    c = cfg(flags + " --overlap-grad-reduce")
    assert megatron_bucket_size(c, 0, 0) == max(40_000_000, 1_000_000 * 64)
    assert megatron_bucket_size(c, 1, 0) is None                                   # pipeline ranks > 0
    assert megatron_bucket_size(cfg(flags + " --overlap-grad-reduce --ddp-bucket-size 1000"), 0, 0) == 1000


def test_static_bytes_to_the_byte_depend_on_dp_rank():
    c = cfg("--model tiny --world-size 2 --bf16 --use-distributed-optimizer")
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


def test_seed_static_bytes_per_card():
    c = cfg(SEED)
    card = params.params_per_rank(c, 1)
    assert bytes_per_param("bf16", "fp32", "zero1", 2).total == 12
    s = static_bytes(c, 1, 1, 1)
    assert s.padding == 0                 # every llama tensor is a multiple of 64, every buffer of 128
    assert s.total == 12 * card
    assert round(s.total / 1e9, 2) == 4.50 and round(s.total / 2 ** 30, 2) == 4.19


def test_rank_out_of_range_is_a_config_error():
    with pytest.raises(ConfigError):
        static_bytes(cfg(SEED), 0, 2, 0)


# ---- activations --------------------------------------------------------------------------------------------------

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
    expected = activations.korthikanti_layer_bytes(s, b, h, nq, t, sp) + _korthikanti_gap(s, b, h, f, nq, t, sp)
    assert activations.layer_bytes(c) == pytest.approx(expected, rel=1e-12)


def test_seed_layer_activations_gqa_swiglu():
    c = cfg(NO_TP_SEED)
    s, b, r = 8192, 1, NKV / NQ
    sbh = s * b * H
    # bf16: 6 [s,b,h] tensors (2 norm inputs, qkv and fc1 inputs, q, attention output) + k and v at n_kv/n_q width,
    # fc1 output (2f) and fc2 input (f); fp32 rstd x2 and logsumexp per head
    expected = 2 * sbh * (6 + 2 * r) + 2 * s * b * 3 * F + 2 * 4 * s * b + 4 * NQ * s * b
    assert activations.layer_bytes(c) == expected
    assert 2 * sbh * (6 + 2 * r) + 2 * s * b * 3 * F == 37 * sbh


def test_sequence_parallel_divides_everything_by_t():
    c_sp = cfg(SEED)
    c_1 = cfg(NO_TP_SEED)
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


def test_full_recompute_keeps_layer_inputs():
    c = cfg(SEED)
    s, b, t = 8192, 1, 2
    layer_input = 2 * s * b * H // t
    none0 = activations.stage_activation_bytes(c, 0)
    full0 = activations.stage_activation_bytes(c, 0, "full")
    in_flight, extras = 2, 2 * 8 * s * b           # stage 0 of p = 2: two micro-batches; token ids
    assert none0 == in_flight * 8 * activations.layer_bytes(c) + extras
    assert full0 == in_flight * 8 * layer_input + activations.layer_bytes(c) + extras


# ---- bubble -------------------------------------------------------------------------------------------------------

def test_seed_bubble():
    c = cfg(SEED)
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
    assert nccl_bw.algbw_from_busbw(1.75e11, "all_reduce", 8) == pytest.approx(1e11)


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


def test_pp_sends_per_microbatch():
    c = cfg(SEED)
    msg = 2 * 8192 * 1 * H // 2                     # [s/t, b, h] under SP
    for stage in (0, 1):
        assert comm.step_collectives(c, stage)["pp.send.activations_and_grads[bf16]"].size_bytes == 8 * msg
    inter = cfg("--model tiny --world-size 2 --pipeline-model-parallel-size 2 "
                "--virtual-pipeline-model-parallel-size 2 --global-batch-size 4")
    # rank 0 holds virtual stages 0 and 2 (0 sends forward; 2 forward and backward): 3 sends a micro-batch
    assert comm.step_collectives(inter, 0)["pp.send.activations_and_grads[fp32]"].calls == 3 * 4


# ---- FLOPs --------------------------------------------------------------------------------------------------------

def test_seed_megatron_flops():
    c = cfg(SEED)
    B, s, q, kv = 16, 8192, NQ * D, NKV * D
    gemm_per_token = L * (H * (q + 2 * kv) + q * H + 3 * H * F) + H * V      # multiply-adds per token, forward
    attention_per_token = L * 2 * s * q / 2                                   # QK^T and PV, causal half
    expected = 3 * 2 * (gemm_per_token + attention_per_token) * B * s        # x2 FMA, x3 forward + 2 backward
    assert flops.megatron_flops_per_step(c) == expected


@pytest.mark.parametrize("flags", [
    SEED, "--model tiny --world-size 2 --tensor-model-parallel-size 2 --global-batch-size 8 --num-query-groups 2",
    "--model llama3.1-8b --world-size 4 --tensor-model-parallel-size 4 --global-batch-size 4"])
def test_the_engines_throughput_counts_the_ledgers_flops(flags):
    """The engine's step log derives Megatron's FLOPs in its own (factored) form; the ledger's term-by-term count is the
    same number, held equal here rather than shared by import."""
    from engine.training import num_floating_point_operations

    c = cfg(flags)
    engine = num_floating_point_operations(c, c.train.global_batch_size)
    assert engine == pytest.approx(flops.megatron_flops_per_step(c), rel=1e-12)


def test_palm_flops_and_mfu():
    c = cfg(SEED)
    n_non_embedding = 1_498_482_688 - V * H
    assert flops.palm_flops_per_token(c) == 6 * n_non_embedding + 12 * L * H * 8192
    assert flops.mfu(989e12 * 8 * 2.0, 2.0, 8) == pytest.approx(1.0)
    assert flops.mfu(1e15, 1.0, 1, peak_flops=2e15) == pytest.approx(0.5)
