"""ledger.models.time_model: a step's time from the run's config and a calibration, specified from first principles.

Every calibration here is a synthetic plumbing/arithmetic fixture, not a device: each kernel costs a round figure
chosen by its name (PRICE_MS, dims ignored), rates and link fits are set by hand, so each expectation is a sum a
reader can redo. The op lists a pass must add up are written here from Megatron Core's TransformerLayer and GPT head
(LAYER_FORWARD, ...), not read from ledger/models/time_model/ops.py or the catalogue (common/ops). What the model
predicts for a real device is tested on recorded H200 runs (tests/test_h200_claims.py).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import pytest

from common.arguments import parse_args
from common.config import RunConfig
from common.events import BandwidthRecord
from common.ops import SUSTAINED, kernel
from ledger.models.simulate.calibration import hardware_calibration
from ledger.models.simulate.hardware import load_hardware
from ledger.models.time_model import (
    Calibration,
    CalibrationMissing,
    CommModel,
    LinkFit,
    buckets,
    ops,
    oversubscription,
    predict_step,
    stage_time,
)
from ledger.models.time_model.calibration import MAX_SUSTAINED, PowerLimit
from tests.support.recorded_runs import reconcile_recorded
from tests.support.records import typed

MS = 1e-3
# Synthetic per-call times (ms) by kernel name; a GEMM costs its linear's figure in each of fprop, dgrad and wgrad.
PRICE_MS = {
    "rms_norm.fwd": 0.02, "rms_norm.bwd": 0.03, "residual_add": 0.01, "rope.fwd": 0.04, "rope.bwd": 0.05,
    "core_attention.fwd": 0.3, "core_attention.bwd": 0.7, "attention_output.copy": 0.06,
    "swiglu.fwd": 0.07, "swiglu.bwd": 0.09, "embedding.fwd": 0.08, "embedding.bwd": 0.11,
    "cross_entropy.fwd": 0.13, "cross_entropy.bwd": 0.17,
    "linear_qkv": 0.2, "linear_proj": 0.1, "linear_fc1": 0.5, "linear_fc2": 0.25, "output_layer": 0.9,
}
OPT_S_PER_ELEMENT, ZERO_S_PER_ELEMENT = 2e-9, 5e-10

# One micro-batch through one Megatron Core layer (TP 1), in execution order.
LAYER_FORWARD = ("rms_norm.fwd", "linear_qkv.fprop", "rope.fwd", "core_attention.fwd", "attention_output.copy",
                 "linear_proj.fprop", "residual_add", "rms_norm.fwd", "linear_fc1.fprop", "swiglu.fwd",
                 "linear_fc2.fprop", "residual_add")
LAYER_BACKWARD = ("linear_fc2.dgrad", "linear_fc2.wgrad", "swiglu.bwd", "linear_fc1.dgrad", "linear_fc1.wgrad",
                  "rms_norm.bwd", "residual_add", "linear_proj.dgrad", "linear_proj.wgrad", "core_attention.bwd",
                  "rope.bwd", "linear_qkv.dgrad", "linear_qkv.wgrad", "rms_norm.bwd", "residual_add")
HEAD_FORWARD = ("rms_norm.fwd", "output_layer.fprop", "cross_entropy.fwd")  # final norm, logits, loss
HEAD_BACKWARD = ("cross_entropy.bwd", "output_layer.dgrad", "output_layer.wgrad", "rms_norm.bwd")
# tiny: h 64, f 176, 8 heads of 8 in 4 query groups (k, v 4 x 8 wide), vocab 1000 (a multiple of 8: unpadded)
H, F, KV, V = 64, 176, 4 * 8, 1000
PARAMS_PER_LAYER = H * H + 2 * H * KV + H * H + 3 * H * F + 2 * H  # q, k v, o, gate up down, two norms


def ms(name: str) -> float:
    return (PRICE_MS[name] if name in PRICE_MS else PRICE_MS[name.split(".")[0]]) * MS


def total(names: tuple[str, ...], price: Callable[[str], float] = ms) -> float:
    return sum(price(n) for n in names)


def cfg(flags: str) -> RunConfig:
    return parse_args(f"--model tiny --bf16 {flags}".split())


def calibration(c: RunConfig, price: Callable[[str], float] = ms, fits: dict | None = None) -> Calibration:
    """A Calibration from `compute` records as the sweep writes them: one per kernel the stages run, at `price`."""
    records = [{"op": k.name, "dims": dict(k.dims), "dtype": c.train.params_dtype, "seconds": price(k.name)}
               for s in range(c.parallel.pipeline_model_parallel_size) for k in ops.kernels(c, s)]
    records += [{"op": "optimizer.step", "dims": {"numel": 1000}, "dtype": c.train.params_dtype,
                 "seconds": 1000 * OPT_S_PER_ELEMENT},
                {"op": "grad_buffer.zero", "dims": {"numel": 1000}, "dtype": c.train.grad_dtype,
                 "seconds": 1000 * ZERO_S_PER_ELEMENT}]
    return dataclasses.replace(Calibration.from_records(typed("compute", records), []), comm=CommModel(fits or {}))


def latency_only(seconds: float) -> LinkFit:
    return LinkFit(alpha=seconds, beta=0.0, sizes=(1,))


NO_P2P = {("pp", "send_recv"): latency_only(0.0)}


def balanced(name: str) -> float:
    """Equal pipeline stages: the ends (embedding, final norm, output layer, loss) and every norm cost nothing."""
    return 0.0 if name.split(".")[0] in ("embedding", "output_layer", "cross_entropy", "rms_norm") else ms(name)


# ---- one pass: the sum of its ops ---------------------------------------------------------------------------------

def test_a_single_stage_pass_is_embedding_layers_and_head_op_by_op():
    layers = 2
    c = cfg(f"--num-layers {layers}")
    t = stage_time(c, calibration(c), 0)
    assert t.forward == pytest.approx(ms("embedding.fwd") + layers * total(LAYER_FORWARD) + total(HEAD_FORWARD))
    assert t.backward == pytest.approx(total(HEAD_BACKWARD) + layers * total(LAYER_BACKWARD) + ms("embedding.bwd"))
    assert t.terms(True)["output_layer"] == pytest.approx(ms("output_layer"))
    assert t.terms(False)["output_layer"] == pytest.approx(2 * ms("output_layer"))


@pytest.mark.parametrize("tp", ["", "--world-size 2 --tensor-model-parallel-size 2 --sequence-parallel"])
def test_the_loss_fused_over_chunks_recomputes_the_logits_in_backward(tp):
    """--cross-entropy-fusion-impl linear: the backward runs the output layer's fprop once more (the chunks'
    recomputed logits), nothing else changes; the TP collectives are the unfused ones (the same count and sizes)."""
    flags = f"--num-layers 2 {tp}"
    plain, c = cfg(flags), cfg(flags + " --cross-entropy-loss-fusion --cross-entropy-fusion-impl linear")
    links = {("tp", kind): latency_only(1e-5) for kind in ("all_reduce", "all_gather", "reduce_scatter")}
    base, fused = (stage_time(x, calibration(x, fits=links), 0) for x in (plain, c))
    assert fused.forward == pytest.approx(base.forward)
    assert fused.backward - base.backward == pytest.approx(ms("output_layer"))
    assert fused.terms(False)["output_layer"] == pytest.approx(3 * ms("output_layer"))

    def collectives(config: RunConfig) -> list:
        return sorted((w.op.kind, w.op.size_bytes) for w in ops.chunk_backward(config, 0, 0)
                      if isinstance(w.op, ops.Collective))
    assert collectives(c) == collectives(plain)


@pytest.mark.parametrize("flags, extra", [
    # selective: core attention's forward again before its backward, in every layer
    ("--recompute-granularity selective", 4 * ms("core_attention.fwd")),
    # full, groups of one layer: each layer's forward up to linear_fc2 (torch's checkpoint stops at the last saved
    # tensor: the final residual add is not repeated)
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
     4 * (total(LAYER_FORWARD) - ms("residual_add"))),
    # full, groups of two: the first layer of a group whole, the second up to linear_fc2
    ("--recompute-granularity full --recompute-method uniform --recompute-num-layers 2",
     2 * (2 * total(LAYER_FORWARD) - ms("residual_add"))),
])
def test_recompute_adds_the_rerun_forward_to_the_backward_only(flags, extra):
    plain, c = cfg("--num-layers 4"), cfg(f"--num-layers 4 {flags}")
    base, recomputed = stage_time(plain, calibration(plain), 0), stage_time(c, calibration(c), 0)
    assert recomputed.forward == pytest.approx(base.forward)
    assert recomputed.backward - base.backward == pytest.approx(extra)
    assert recomputed.terms(False)["recompute"] == pytest.approx(extra)


def test_tp_collectives_sit_inside_the_passes_at_megatrons_places():
    # TP 2 without SP: forward all-reduces the embedding output and linear_proj's and linear_fc2's outputs, and the
    # vocab-parallel loss three fp32 [s, b] tensors; backward all-reduces linear_qkv's and linear_fc1's input grads
    # and the output layer's. Each an [s, b, h] bf16 activation but the loss's.
    layers, s, b = 2, 32, 1
    alpha, beta = 10e-6, 1e-9
    c = cfg(f"--num-layers {layers} --world-size 2 --tensor-model-parallel-size 2 --global-batch-size 8")
    cal = calibration(c, fits={("tp", "all_reduce"): LinkFit(alpha, beta, (1,))})
    t = stage_time(c, cal, 0).chunks[0]
    bus = 2 * (2 - 1) / 2  # all-reduce over 2 ranks

    def all_reduce(size_bytes: int) -> float:
        return alpha + beta * size_bytes * bus

    activation, loss = 2 * s * b * H, 4 * s * b
    assert t.forward.comm == pytest.approx((2 * layers + 1) * all_reduce(activation) + 3 * all_reduce(loss))
    assert t.backward.comm == pytest.approx((2 * layers + 1) * all_reduce(activation))
    m = 8  # every micro-batch's passes: TP collectives are on the compute stream, nothing hides them
    assert predict_step(c, cal).stages[0].exposed["tp"] == pytest.approx(m * (t.forward.comm + t.backward.comm))


# ---- the step ---------------------------------------------------------------------------------------------------

def test_without_pipelining_a_step_is_memset_then_every_microbatch_then_the_optimizer():
    layers, m = 2, 8
    c = cfg(f"--num-layers {layers} --global-batch-size {m}")
    f = ms("embedding.fwd") + layers * total(LAYER_FORWARD) + total(HEAD_FORWARD)
    b = total(HEAD_BACKWARD) + layers * total(LAYER_BACKWARD) + ms("embedding.bwd")
    params = V * H + layers * PARAMS_PER_LAYER + H  # tied, + final norm; no DP: nothing padded, nothing sharded
    memset, optimizer = ZERO_S_PER_ELEMENT * params, OPT_S_PER_ELEMENT * params
    p = predict_step(c, calibration(c))
    assert p.step_time == pytest.approx(memset + m * (f + b) + optimizer)
    assert p.tokens_per_s == pytest.approx(m * 32 / p.step_time)
    expected = {"grad buffer memset": memset, "forward/backward compute": m * (f + b), "optimizer": optimizer}
    assert {k: v for k, v in p.terms.items() if abs(v) > 1e-12} == pytest.approx(expected)
    assert sum(p.terms.values()) == pytest.approx(p.step_time)
    assert p.stages[0].bubble == pytest.approx(0.0, abs=1e-12)
    assert p.stages[0].optimizer == pytest.approx(optimizer)


@pytest.mark.parametrize("p, m", [(2, 8), (2, 4), (4, 8)])
def test_1f1b_with_equal_stages_and_no_comm_has_the_textbook_bubble(p, m):
    c = cfg(f"--num-layers 4 --world-size {p} --pipeline-model-parallel-size {p} --global-batch-size {m}")
    prediction = predict_step(c, calibration(c, balanced, NO_P2P))
    for stage in prediction.stages:
        assert stage.bubble == pytest.approx((p - 1) / (m + p - 1))
        assert stage.bubble_without_comm == pytest.approx((p - 1) / (m + p - 1))


@pytest.mark.parametrize("p, v, m", [(2, 2, 8), (2, 2, 4), (4, 2, 8)])
def test_interleaved_with_equal_chunks_has_the_textbook_bubble(p, v, m):
    c = cfg(f"--num-layers {p * v} --world-size {p} --pipeline-model-parallel-size {p} "
            f"--virtual-pipeline-model-parallel-size {v} --global-batch-size {m}")
    prediction = predict_step(c, calibration(c, balanced, NO_P2P))
    for stage in prediction.stages:
        assert stage.bubble == pytest.approx((p - 1) / (v * m + p - 1))


def test_a_heavier_last_stage_shows_in_the_first_stages_bubble():
    # Stage 1 holds the final norm, output layer and loss: in 1F1B it runs its m (F, B) pairs back to back from the
    # end of stage 0's first forward, and stage 0 waits for it, then runs its last backward:
    #   span = f0 + m (f1 + b1) + b0,  bubble_s = 1 - m (f_s + b_s) / span
    m = 8
    c = cfg(f"--num-layers 4 --world-size 2 --pipeline-model-parallel-size 2 --global-batch-size {m}")
    f0, b0 = ms("embedding.fwd") + 2 * total(LAYER_FORWARD), 2 * total(LAYER_BACKWARD) + ms("embedding.bwd")
    f1, b1 = 2 * total(LAYER_FORWARD) + total(HEAD_FORWARD), total(HEAD_BACKWARD) + 2 * total(LAYER_BACKWARD)
    span = f0 + m * (f1 + b1) + b0
    prediction = predict_step(c, calibration(c, fits=NO_P2P))
    assert prediction.span == pytest.approx(span)
    assert prediction.stages[0].bubble == pytest.approx(1 - m * (f0 + b0) / span)
    assert prediction.stages[1].bubble == pytest.approx(1 - m * (f1 + b1) / span)
    assert prediction.stages[0].bubble > 1 / 9  # above the textbook's equal stages
    assert prediction.critical_stage == 0  # its last backward ends the pipeline
    assert prediction.terms["pipeline bubble"] == pytest.approx(span - m * (f0 + b0))


def test_p2p_transfers_are_priced_once_per_sending_item_and_lengthen_the_bubble():
    m, transfer = 8, 0.2 * MS
    c = cfg(f"--num-layers 4 --world-size 2 --pipeline-model-parallel-size 2 --global-batch-size {m}")
    prediction = predict_step(c, calibration(c, balanced, {("pp", "send_recv"): latency_only(transfer)}))
    for stage in prediction.stages:  # stage 0 sends m activations, stage 1 m gradients
        assert stage.exposed["pp"] == pytest.approx(m * transfer)
        assert stage.bubble_without_comm == pytest.approx(1 / 9)
        assert stage.bubble > stage.bubble_without_comm


# ---- DP buckets -------------------------------------------------------------------------------------------------

def dp_run(alpha: float):
    """DP 2, --overlap-grad-reduce, a bucket size of exactly the final norm + one layer: reverse registration order
    puts the final norm and layer 1 in bucket 0, layer 0 and the (tied) embedding in bucket 1. Every grad
    all-reduce takes `alpha` (latency only)."""
    layers, m = 2, 4
    c = cfg(f"--num-layers {layers} --world-size 2 --global-batch-size {2 * m} --overlap-grad-reduce "
            f"--ddp-bucket-size {H + PARAMS_PER_LAYER}")
    f = ms("embedding.fwd") + layers * total(LAYER_FORWARD) + total(HEAD_FORWARD)
    b = total(HEAD_BACKWARD) + layers * total(LAYER_BACKWARD) + ms("embedding.bwd")
    memset = ZERO_S_PER_ELEMENT * (V * H + layers * PARAMS_PER_LAYER + H)
    last_backward = memset + m * f + (m - 1) * b
    # layer 1's last gradient (its input norm's) is final after the head's backward and its own, less the residual
    ready0 = total(HEAD_BACKWARD) + total(LAYER_BACKWARD) - ms("residual_add")
    prediction = predict_step(c, calibration(c, fits={("dp", "all_reduce"): latency_only(alpha)}))
    return prediction, last_backward, ready0, b


def test_a_bucket_issued_early_in_the_last_backward_is_hidden_and_the_last_one_exposed():
    alpha = 1 * MS  # shorter than the backward left after bucket 0 is ready (layer 0 and the embedding: ~3.1 ms)
    prediction, last_backward, ready0, b = dp_run(alpha)
    grads = sorted((x for x in prediction.buckets if x.op == "all_reduce"), key=lambda x: x.bucket)
    assert [x.bucket for x in grads] == [0, 1]
    assert grads[0].issue == pytest.approx(last_backward + ready0)
    assert grads[0].exposed == pytest.approx(0.0, abs=1e-12)
    assert grads[1].issue == pytest.approx(last_backward + b)  # the embedding's gradient is final last
    assert grads[1].exposed == pytest.approx(alpha)
    assert prediction.stages[0].exposed["dp"] == pytest.approx(alpha)
    assert prediction.terms["DP grad reduction tail"] == pytest.approx(alpha)
    assert prediction.terms["loss all-reduce"] == pytest.approx(alpha)  # 4 bytes: the latency


def test_buckets_run_one_after_another_and_a_long_first_one_delays_the_last():
    alpha = 5 * MS  # longer than the rest of the backward: bucket 0 spills past it, bucket 1 queues behind it
    prediction, last_backward, ready0, b = dp_run(alpha)
    grads = sorted((x for x in prediction.buckets if x.op == "all_reduce"), key=lambda x: x.bucket)
    end_of_backward = last_backward + b
    assert grads[0].end == pytest.approx(last_backward + ready0 + alpha)
    assert grads[1].start == pytest.approx(grads[0].end)
    assert grads[0].exposed == pytest.approx(grads[0].end - end_of_backward)
    assert prediction.stages[0].exposed["dp"] == pytest.approx(grads[1].end - end_of_backward)


def test_exposed_time_is_the_union_of_the_collectives_less_compute_not_a_sum():
    # two collectives overlapping on [1, 2], compute covering [0, 0.5]: 3 s of comm wall time, 0.5 s hidden
    assert buckets.exposed([(0.0, 2.0), (1.0, 3.0)], [(0.0, 0.5)]) == pytest.approx(2.5)
    assert buckets.exposed([(0.0, 2.0)], [(0.0, 0.5), (1.5, 4.0)]) == pytest.approx(1.0)
    assert buckets.serial([(0.0, 1.0), (0.5, 1.0), (5.0, 1.0)]) == [(0.0, 1.0), (1.0, 2.0), (5.0, 6.0)]


def test_no_param_all_gather_is_issued_before_zero_grad_and_chunk_1s_follow_chunk_0s():
    # The engine's step: zero_grad (the memset) issues chunk 0's all-gathers, then chunk 0's first forward issues
    # chunk 1's; nothing can be issued at the step's start, before the memset ends.
    c = cfg("--num-layers 4 --world-size 4 --pipeline-model-parallel-size 2 --virtual-pipeline-model-parallel-size 2 "
            "--global-batch-size 8 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather")
    fits = {("dp", k): latency_only(0.1 * MS) for k in ("all_gather", "reduce_scatter", "all_reduce")}
    prediction = predict_step(c, calibration(c, fits={**fits, **NO_P2P}))
    memset = prediction.terms["grad buffer memset"]
    assert memset > 0
    gathers = [b for b in prediction.buckets if b.op == "all_gather" and b.stage == 0]
    assert {b.chunk for b in gathers} == {0, 1}
    assert all(b.issue >= memset for b in gathers)
    assert min(b.issue for b in gathers if b.chunk == 1) >= max(b.issue for b in gathers if b.chunk == 0)


# ---- communication ----------------------------------------------------------------------------------------------

def sweep_record(size_bytes: int, seconds: float, rank_group: list[int], group: str = "dp",
                 collective: str = "all_reduce") -> BandwidthRecord:
    return BandwidthRecord(group=group, collective=collective, group_size=len(rank_group), ranks=rank_group,
                           size_bytes=size_bytes, time_s=seconds)


def test_a_collective_costs_latency_plus_bus_bytes_over_bandwidth():
    alpha, busbw = 20e-6, 100e9
    group = [0, 1]

    def t(size: int) -> float:
        return alpha + size * 2 * (2 - 1) / 2 / busbw  # all-reduce bus factor 2(n-1)/n

    sizes = [8, 1 << 20, 1 << 26]  # the latency point (one fp32 element per rank) and two bucket sizes
    comm = CommModel.from_sweep([sweep_record(s, t(s), group) for s in sizes])
    fit = comm.fit("dp", "all_reduce")
    assert fit.alpha == pytest.approx(alpha) and fit.busbw == pytest.approx(busbw)
    assert comm.seconds("dp", "all_reduce", 2, 4) >= alpha  # a 4-byte all-reduce costs its latency, not 4 B / bw
    # the fit is in bus bytes, so it prices another group size on the same link: 2(n-1)/n = 1.5 for n = 4
    assert comm.seconds("dp", "all_reduce", 4, 1 << 26) == pytest.approx(alpha + (1 << 26) * 1.5 / busbw)
    assert comm.seconds("dp", "all_reduce", 1, 1 << 26) == 0.0  # nothing moves in a group of one


def test_each_size_is_timed_by_its_slowest_rank():
    records = [sweep_record(1 << 20, 3e-3, [0, 1]), sweep_record(1 << 20, 1e-3, [0, 1])]
    assert CommModel.from_sweep(records).seconds("dp", "all_reduce", 2, 1 << 20) == pytest.approx(3e-3)


# ---- calibration ------------------------------------------------------------------------------------------------

def test_at_the_power_limit_every_kernel_of_the_passes_slows_and_the_rates_do_not():
    gemm, norm = kernel("linear_fc1.fprop", 1.0, m=1, n=1, k=1), kernel("rms_norm.fwd", tokens=1, hidden=1)
    records = [{"op": gemm.name, "dims": dict(gemm.dims), "dtype": "bf16", "seconds": 1e-3},
               {"op": norm.name, "dims": dict(norm.dims), "dtype": "bf16", "seconds": 1e-3},
               {"op": "optimizer.step", "dims": {"numel": 1000}, "dtype": "bf16", "seconds": 1e-3},
               # back to back: 1.8 ms a pass of 1 ms compute-bound + 0.5 ms memory-bound isolated kernels -> x1.2,
               # the compute-bound kernels 2/3 of the pass
               {"op": SUSTAINED, "dims": {}, "dtype": "bf16", "seconds": 1.8e-3, "compute_bound_s": 1e-3,
                "memory_bound_s": 0.5e-3}]
    cal = Calibration.from_records(typed("compute", records), [])
    assert cal.sustained == pytest.approx(1.2)
    assert cal.power == PowerLimit(pytest.approx(1.2), pytest.approx(2 / 3), None)
    assert cal.kernel_seconds(gemm, "bf16") == pytest.approx(1.2e-3)
    assert cal.kernel_seconds(norm, "bf16") == pytest.approx(1.2e-3)
    assert cal.rate_seconds("optimizer.step", "bf16", 1000) == pytest.approx(1e-3)
    shared = Calibration.from_records(typed("compute", records), [], compute_scale=3.0)
    assert shared.kernel_seconds(norm, "bf16") == pytest.approx(3.6e-3)


def test_the_power_limits_slowdown_is_a_line_in_the_compute_bound_share_from_its_threshold():
    limit = PowerLimit(full_factor=1.15, full_share=0.95, threshold_share=0.636)
    assert limit.factor(0.5) == limit.factor(0.636) == 1.0  # under the limit at boost clock
    assert limit.factor(0.95) == limit.factor(0.99) == pytest.approx(1.15)  # no more than the back-to-back loop
    # halfway along the line, half the slowdown: the dense H200 step's share 0.793 -> x1.075
    assert limit.factor((0.636 + 0.95) / 2) == pytest.approx(1.075)
    assert PowerLimit(1.15, 0.95).factor(0.3) == 1.15  # no threshold known: the full factor, as before it was measured


def test_a_step_is_priced_at_the_factor_of_its_own_compute_bound_share():
    cfg = parse_args(["--model", "llama3.2-1b", "--seq-length", "4096", "--micro-batch-size", "1",
                      "--global-batch-size", "8", "--bf16", "--use-distributed-optimizer"], world_size=1)
    cal = hardware_calibration(cfg, load_hardware("H200"))
    step = predict_step(cfg, cal)
    # the fixed point: the factor the step was priced at is the line's at the step's own share
    assert step.power_factor == pytest.approx(cal.power.factor(step.power_share), abs=1e-3)
    assert 1.0 < step.power_factor < cal.power.full_factor
    full = predict_step(cfg, dataclasses.replace(cal, power=PowerLimit(cal.power.full_factor, cal.power.full_share)))
    assert full.power_factor == cal.power.full_factor and full.step_time > step.step_time


def test_a_sustained_record_the_host_paced_leaves_compute_at_its_isolated_speed():
    # A layer whose kernels are shorter than their launches: the back-to-back pass times the host (the launch-bound
    # H200 run lb_h1024_l4_s512's record: 778 µs a pass over 255 µs of kernels, "x3.05"); no clock drop at the power
    # limit is that large (MAX_SUSTAINED), so the factor is 1 and the calibration says why.
    gemm = kernel("linear_fc1.fprop", 1.0, m=1, n=1, k=1)
    records = [{"op": gemm.name, "dims": dict(gemm.dims), "dtype": "bf16", "seconds": 1e-3},
               {"op": SUSTAINED, "dims": {}, "dtype": "bf16", "seconds": 3.5e-3, "compute_bound_s": 1e-3,
                "memory_bound_s": 0.5e-3}]
    cal = Calibration.from_records(typed("compute", records), [])
    assert cal.sustained == 1.0 and cal.power is None and cal.kernel_seconds(gemm, "bf16") == pytest.approx(1e-3)
    assert "host-paced (a slowdown of x2.33" in cal.host_note
    edge = Calibration.from_records(typed("compute", [*records[:1], {**records[1], "seconds": 1.5e-3 * 1.35}]), [])
    assert edge.sustained == pytest.approx(MAX_SUSTAINED)


def test_ranks_record_one_kernel_each_and_the_median_counts():
    k = kernel("residual_add", numel=8)
    records = [{"op": k.name, "dims": {"numel": 8}, "dtype": "fp32", "seconds": s} for s in (1e-3, 2e-3, 9e-3)]
    assert Calibration.from_records(typed("compute", records), []).kernel_seconds(k, "fp32") == pytest.approx(2e-3)


def test_oversubscribed_cpu_ranks_compute_slower_by_the_cores_they_lose():
    assert oversubscription(ranks=4, cores=2, threads=1) == 2.0  # four single-thread ranks on two cores
    assert oversubscription(ranks=2, cores=8, threads=2) == 1.0  # enough cores: as measured
    assert oversubscription(ranks=2, cores=4, threads=8) == 2.0  # 8 threads had the 4 cores alone, share them now


# ---- what is missing --------------------------------------------------------------------------------------------

def test_without_compute_records_the_model_says_so_and_names_the_probe():
    """...and, for a run that has no sweep to give (Megatron-LM's), the flags that price it otherwise."""
    c = cfg("--num-layers 2")
    with pytest.raises(CalibrationMissing, match=r"no compute sweep records \(--compute-sweep\).*--hardware .*"
                                                 r"--calibration FILE"):
        stage_time(c, Calibration.from_records([], []), 0)


def test_a_kernel_the_sweep_did_not_record_is_named_with_its_dims_and_the_probe():
    c = cfg("--num-layers 2")
    cal = calibration(c)
    key = next(k for k in cal.kernels if k[0] == "output_layer.wgrad")
    partial = dataclasses.replace(cal, kernels={k: v for k, v in cal.kernels.items() if k != key})
    with pytest.raises(CalibrationMissing) as missing:
        stage_time(c, partial, 0)
    assert "output_layer.wgrad[k=32, m=1000, n=64] (bf16)" in str(missing.value)
    assert "--compute-sweep" in str(missing.value)


def test_a_missing_rate_or_link_is_named_with_its_probe():
    c = cfg("--num-layers 4 --world-size 2 --pipeline-model-parallel-size 2 --global-batch-size 8")
    stage_time(c, calibration(c), 1)  # the passes need no link
    with pytest.raises(CalibrationMissing, match=r"send_recv on the pp group \(--bandwidth-sweep\)"):
        predict_step(c, calibration(c))
    single = cfg("--num-layers 2")
    cal = calibration(single)
    no_rates = dataclasses.replace(cal, rates={k: v for k, v in cal.rates.items() if k[0] != "optimizer.step"})
    with pytest.raises(CalibrationMissing) as missing:
        predict_step(single, no_rates)
    assert "optimizer.step (bf16)" in str(missing.value) and "--compute-sweep" in str(missing.value)


def test_an_end_stages_term_names_its_parameters_exactly(tmp_path):
    """gloo_4ranks_2cores (tiny, TP1): the embedding's term carries vocab 1,000 x hidden 64 = 64,000 parameters,
    written as the count, not rounded to "0 M"."""
    import shutil
    from pathlib import Path


    shutil.copytree(Path(__file__).parent / "fixtures" / "gloo_4ranks_2cores", tmp_path / "run")
    forward = [r for r in reconcile_recorded(tmp_path / "run").rows if r.metric == "time.forward_per_microbatch"]
    assert any("embedding" in r.explanation and "(64,000 params)" in r.explanation for r in forward)
    assert not any(" M params" in r.explanation for r in forward)
