"""--moe-delay-expert-wgrad: each expert weight's gradient computed once a step, over every micro-batch's rows.

Each backward holds the expert linears' two weight-gradient operands instead of running the GEMM; finalize_model_grads
adds (all held grad_outputs)^T (all held inputs) into main_grad, one GEMM a weight. The sum over micro-batches is the
same sum in another order, so the gradients and a whole training run are the per-micro-batch ones (fp32, CPU, 1e-5).
Why it exists: on an H200 an expert's wgrad at ~1,000 rows into the fp32 main_grad ran at 410-430 TFLOP/s, and once
over 8 micro-batches' rows at 680-690 (BENCHMARKS.md, runs/bench/expert_wgrad.py).
"""
from __future__ import annotations

import pytest
import torch

from cli.main import main as cli
from common.arguments import parse_args
from common.ops.kernel import Kernel
from common.ops.moe import DELAYED_CAT
from common.ops.traffic import bytes_moved
from engine.tensor_parallel.layers import flush_delayed_weight_grads
from engine.tensor_parallel.mappings import TPGroup
from engine.transformer.moe.expert_parallel import EPGroup
from engine.transformer.moe.grouped_gemm_util import HostCounts
from engine.transformer.moe.moe_layer import MoEContext, MoELayer
from ledger.models.formulas.activations import (
    delayed_wgrad_bytes,
    delayed_wgrad_flush_bytes,
    end_of_forward_bytes,
    in_flight,
    last_stage_extra_bytes,
    layers_backward_before_last_forward,
    stage_activation_bytes,
    stage_chunk_layers,
)
from ledger.models.formulas.peak_phases import peak_phase, stage_phases
from ledger.models.simulate.hardware import load_hardware
from ledger.models.simulate.pricing import Pricing
from ledger.models.time_model.ops import chunk_backward, chunk_forward, delayed_expert_wgrad
from ledger.reconcile.pipeline import delayed_share
from tests.support.parity import assert_flags_change_no_training

MOE = "--model tiny --num-experts 4 --moe-router-topk 2 --seq-length 32 --micro-batch-size 2"
MICROBATCHES = 3


def _layer(delay: bool, flags: str = "") -> MoELayer:
    """The layer with every parameter's main_grad owned as DDP owns it (zeroed, the fusion's flag down)."""
    cfg = parse_args((MOE + (" --moe-delay-expert-wgrad" if delay else "") + flags).split())
    layer = MoELayer(cfg.model, 0, moe=MoEContext(ep=EPGroup(None, 1, 0)), tp=TPGroup(None, 1, 0),
                     params_dtype=torch.float32, device="cpu", seed=3)
    for param in layer.parameters():
        param.main_grad = torch.zeros_like(param)
        param.grad_added_to_main_grad = False
    return layer


def _backwards(layer: MoELayer) -> None:
    """MICROBATCHES forward-backward passes, each gradient that autograd leaves in .grad added to main_grad as DDP's
    hook would (skipped where the linear added into main_grad itself)."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(MICROBATCHES):
        y = layer(torch.randn(32, 2, 64, generator=gen))
        y.backward(torch.randn(y.shape, generator=gen))
        for param in layer.parameters():
            if param.grad is not None and not param.grad_added_to_main_grad:
                param.main_grad += param.grad
            param.grad, param.grad_added_to_main_grad = None, False


def _experts(layer: MoELayer) -> dict[str, torch.nn.Parameter]:
    return {n: p for n, p in layer.named_parameters() if n.startswith("experts.")}


def test_the_experts_gradients_wait_for_the_flush_then_equal_the_per_microbatch_sums():
    plain, delayed = _layer(False), _layer(True)
    _backwards(plain)
    _backwards(delayed)
    for name, param in _experts(delayed).items():
        held = param.delayed_wgrad
        assert len(held) == MICROBATCHES and not param.main_grad.any(), name  # held, nothing added yet
    flush_delayed_weight_grads(delayed)
    expected = dict(plain.named_parameters())
    for name, param in delayed.named_parameters():
        assert not getattr(param, "delayed_wgrad", None)  # dropped once added
        torch.testing.assert_close(param.main_grad, expected[name].main_grad, rtol=1e-5, atol=1e-6,
                                   msg=lambda m, n=name: f"{n}: {m}")
    assert all(not hasattr(p, "delayed_wgrad") for n, p in delayed.named_parameters() if not n.startswith("experts."))


def test_the_grouped_moment_is_left_out_where_full_recompute_rebuilds_the_last_layer():
    # Rebuilt in its own backward, the layer's saved tensors are not the forward's: that moment is not modelled.
    flags = MIXTRAL.replace("--moe-pad-expert-rows 16", "--moe-grouped-gemm").replace(" --moe-delay-expert-wgrad", "")
    names = {method: [p.name for p in stage_phases(parse_args((
        f"{flags} --recompute-granularity full --recompute-method {method} --recompute-num-layers 1").split()), 0)]
        for method in ("uniform", "block")}
    assert not [n for n in names["uniform"] if n.startswith("grouped")]  # every layer rebuilt
    assert [n for n in names["block"] if n.startswith("grouped")]  # only the first layer rebuilt


@pytest.mark.parametrize("delay", [False, True], ids=["fused", "delayed"])
def test_grouped_experts_read_their_row_counts_where_their_weight_gradients_run(delay, monkeypatch):
    """--moe-grouped-gemm: the split of the rows among experts is a device copy the host reads. Each backward needs
    it where it runs the experts' wgrads; delayed, the backward holds the whole operands and only the flush reads it
    (a read in backward holds the host until the device has run the forward that made the counts: 46 ms of a
    mixtral-8x7b-2l step on one H200)."""
    reads: list[int] = []
    read = HostCounts.tolist
    monkeypatch.setattr(HostCounts, "tolist", lambda self: reads.append(1) or read(self))
    grouped, plain = _layer(delay, " --moe-grouped-gemm"), _layer(False)
    _backwards(grouped)
    assert bool(reads) == (not delay)
    flush_delayed_weight_grads(grouped)
    assert reads
    _backwards(plain)
    for name, param in grouped.named_parameters():
        torch.testing.assert_close(param.main_grad, dict(plain.named_parameters())[name].main_grad, rtol=1e-5,
                                   atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_padded_experts_hold_their_own_operands_so_no_held_view_keeps_a_whole_tensor():
    """--moe-pad-expert-rows with --moe-delay-expert-wgrad: every expert's held operands are tensors of their own,
    the unpadded experts' too (a view would keep the layer's dispatched rows, or combine's gradient, alive to the
    flush), and the flushed gradients are still the per-micro-batch sums."""
    cfg = parse_args((MOE + " --moe-pad-expert-rows 4 --moe-delay-expert-wgrad").split())
    layer = MoELayer(cfg.model, 0, moe=MoEContext(ep=EPGroup(None, 1, 0)), tp=TPGroup(None, 1, 0),
                     params_dtype=torch.float32, device="cpu", seed=3)
    plain = _layer(False)
    for param in layer.parameters():
        param.main_grad = torch.zeros_like(param)
        param.grad_added_to_main_grad = False
    _backwards(layer)
    _backwards(plain)
    counts = layer.record.tokens.tolist()
    assert any(c % 4 == 0 for c in counts) and any(c % 4 for c in counts)  # unpadded and padded experts both
    for name, param in _experts(layer).items():
        for held in (t for operands in param.delayed_wgrad for t in operands.tensors()):  # storage: its own bytes
            assert held.untyped_storage().nbytes() == held.numel() * held.element_size(), name
    flush_delayed_weight_grads(layer)
    for name, param in _experts(layer).items():
        torch.testing.assert_close(param.main_grad, dict(plain.named_parameters())[name].main_grad, rtol=1e-5,
                                   atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("experts", [[], ["--moe-grouped-gemm"]], ids=["sequential", "grouped"])
def test_a_training_run_with_delayed_expert_gradients_is_the_per_microbatch_run(experts):
    base = ["--model", "tiny", "--num-layers", "2", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--train-iters", "4", "--lr", "3e-3", "--clip-grad", "0.05", "--mock-data", "--num-experts", "4",
            "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01", *experts]
    # The losses and grad norms to 1e-5; the parameters to 2e-6 absolute: the experts' gradients are the same sums in
    # another order, and Adam's m / sqrt(v) moves an element whose gradient is near zero by that rounding's ratio.
    assert_flags_change_no_training(base, ["--moe-delay-expert-wgrad"], param_atol=2e-6)


@pytest.mark.parametrize("flags, problem", [
    ("--model tiny", "--moe-delay-expert-wgrad needs --num-experts"),
    (MOE + " --overlap-grad-reduce --use-distributed-optimizer", "not with --overlap-grad-reduce"),
    (MOE + " --no-gradient-accumulation-fusion", "not with --no-gradient-accumulation-fusion")])
def test_where_the_delay_cannot_hold_it_is_one_line_and_exit_2(capsys, flags, problem):
    code = cli(["plan", *flags.split(), "--moe-delay-expert-wgrad"])
    err = capsys.readouterr().err
    assert code == 2 and problem in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


MIXTRAL = ("--model mixtral-8x7b-2l --bf16 --micro-batch-size 1 --global-batch-size 8 --moe-pad-expert-rows 16 "
           "--moe-delay-expert-wgrad")
ROW_BYTES = 2 * (2 * 4096 + 2 * 14336 + 14336)  # bf16: fc1's input and output gradient, fc2's input and output gradient


def test_the_ledger_holds_each_backwards_expert_operands_until_the_flush():
    """mixtral-8x7b-2l at seq 4096: T k = 4,096 x 2 = 8,192 rows a layer (1,024 an expert, a multiple of 16), each
    leaving h + 2f + f + h = 51,200 bf16 values held: 838,860,800 B a layer and micro-batch, 8 x 2 of them by the
    flush, beside one fc1's concatenated operands (8 x 1,024 rows x (2f + h)). The last steady backward holds the
    7 earlier micro-batches' and, in the output layer's backward, the logits' gradient, the output weight's
    placeholder (32,000 x 4,096 bf16 each) and the layer's input gradient (4,096 x 4,096 bf16), the loss's saved
    logits freed."""
    cfg = parse_args(MIXTRAL.split())
    assert delayed_wgrad_bytes(cfg) == 8192 * ROW_BYTES == 838_860_800
    assert delayed_wgrad_flush_bytes(cfg) == 8 * 1024 * (2 * 14336 + 4096) * 2
    plain = stage_phases(parse_args(MIXTRAL.replace(" --moe-delay-expert-wgrad", "").split()), 0)
    saved, loss, output, last, last_loss, last_output, flush = stage_phases(cfg, 0)
    assert plain == [saved, loss, output]
    held = 7 * 2 * 838_860_800
    assert last.activations == saved.activations + held and not last.transients
    assert last_loss.activations == loss.activations + held and last_loss.transients == loss.transients
    assert last_output.activations == output.activations + held
    assert last_output.transients == {"the loss's gradient (logits)": 262_144_000,
                                      "output weight's gradient": 262_144_000,
                                      "output layer's input gradient": 4096 * 4096 * 2}
    assert peak_phase(cfg, 0) == last_output
    assert flush.activations == 8 * 2 * 838_860_800


def test_the_held_operands_follow_each_chunks_layers_where_the_ends_count_as_layers():
    """PP 2 x 2 chunks of 2 layers with the embedding and the loss as layer slots: 4 slots, one a virtual stage, so
    stage 0's chunks hold 0 layers (the embedding) and 1. Its schedule over 4 micro-batches (warmup 4 forwards, then
    F4 B0 F5 B1 F6 B2 F7 ...; backward k runs chunk 1 - (k // 2) % 2) has run the backwards of chunks 1, 1, 0 when its
    last forward ends: 2 layers' operands held, where the larger chunk times the 8 - 5 in flight would say 3; the flush
    holds 4 micro-batches x 1 layer, where 4 x 2 chunks x the larger chunk would say 8."""
    cfg = parse_args((MOE.replace("--micro-batch-size 2", "--micro-batch-size 1") + " --num-layers 2"
                      " --moe-delay-expert-wgrad --pipeline-model-parallel-size 2"
                      " --virtual-pipeline-model-parallel-size 2 --account-for-embedding-in-pipeline-split"
                      " --account-for-loss-in-pipeline-split --global-batch-size 4").split(), world_size=2)
    assert stage_chunk_layers(cfg, 0) == (0, 1)
    assert layers_backward_before_last_forward(cfg, 0) == 2
    per_layer, saved = delayed_wgrad_bytes(cfg), stage_activation_bytes(cfg, 0)
    phases = {phase.name: phase for phase in stage_phases(cfg, 0)}
    assert phases["delayed expert wgrads"].activations == 4 * per_layer
    assert phases["last steady backward, the earlier backwards' expert operands held"].activations \
        == saved + 2 * per_layer


@pytest.mark.parametrize("pp, vpp, stage", [(1, 1, 0), (2, 1, 0), (2, 1, 1), (4, 1, 1), (2, 2, 0), (4, 2, 1)])
def test_with_chunks_alike_the_walk_is_the_backwards_outside_the_in_flight_ones(pp, vpp, stage):
    """Chunks of equal layers: the backwards run before the last forward are all but the in-flight ones."""
    cfg = parse_args(f"--model tiny --num-layers 8 --pipeline-model-parallel-size {pp} --micro-batch-size 1"
                     f" --global-batch-size 8{f' --virtual-pipeline-model-parallel-size {vpp}' if vpp > 1 else ''}"
                     .split(), world_size=pp)
    chunk = 8 // (pp * vpp)
    assert layers_backward_before_last_forward(cfg, stage) == (8 * vpp - in_flight(cfg, stage)) * chunk


def test_grouped_the_held_operands_are_every_rows_and_the_flush_each_experts():
    """--moe-grouped-gemm at EP 1 carries every assignment's row (T k = 8,192, the dropped ones too): each expert's
    held operands are slices of the whole tensors, so a layer and micro-batch holds all 8,192 rows' (as SequentialMLP
    padded to 16 does here: 1,024 an expert); no grouped wgrad runs in the backward, and the flush is each expert's
    over the step's 8 x 1,024 rows."""
    cfg = parse_args(MIXTRAL.replace("--moe-pad-expert-rows 16", "--moe-grouped-gemm").split())
    assert delayed_wgrad_bytes(cfg) == 8192 * ROW_BYTES
    backward = [w.op.name for w in chunk_backward(cfg, 0, 0)]
    assert "experts.linear_fc1.dgrad" in backward and not [n for n in backward if n.endswith(".wgrad")
                                                           and "experts" in n]
    flush = delayed_expert_wgrad(cfg, 0)
    assert [w.op.name for w in flush] == [DELAYED_CAT, "linear_fc2.wgrad", DELAYED_CAT, "linear_fc1.wgrad"] * 16
    assert {dict(w.op.dims)["k"] for w in flush if w.op.name != DELAYED_CAT} == {8 * 1024}


@pytest.mark.parametrize("delayed", [False, True], ids=["plain", "delayed"])
def test_grouped_experts_peak_as_their_fc1_returns_every_experts_weight_gradient(delayed):
    """mixtral-8x7b-2l, --moe-grouped-gemm: the last layer's grouped fc1 backward returns the 8 experts' weight
    gradient placeholders at once, 8 x 28,672 x 4,096 bf16 = 1.75 GiB, beside fc1's output gradient (8,192 x 28,672),
    its input gradient (8,192 x 4,096) and the residual stream's (4,096 x 4,096); the loss, output layer and final
    norm, and this layer's combine rows (8,193 x 4,096) and SwiGLU input are freed, and fc2's input (8,192 x 14,336)
    too unless the flush holds it, with fc2's output gradient beside it. That moment outweighs the output layer's
    backward by about a GiB, and under --moe-delay-expert-wgrad it holds the 7 earlier micro-batches' operands."""
    flags = MIXTRAL.replace("--moe-pad-expert-rows 16", "--moe-grouped-gemm")
    cfg = parse_args((flags if delayed else flags.replace(" --moe-delay-expert-wgrad", "")).split())
    phase = peak_phase(cfg, 0)
    assert phase.name == ("last steady backward's " if delayed else "") + \
        "grouped expert fc1 backward (the chunk's last layer)"
    transients = {"fc1's output gradient": 8192 * 28672 * 2, "fc1's input gradient": 8192 * 4096 * 2,
                  "every local expert's fc1 weight gradient": 8 * 28672 * 4096 * 2,
                  "residual stream gradient": 4096 * 4096 * 2}
    if delayed:
        transients["fc2's output gradient (held for the flush)"] = 8192 * 4096 * 2
    assert phase.transients == transients
    freed = 8193 * 4096 * 2 + 8192 * 28672 * 2 + (0 if delayed else 8192 * 14336 * 2)
    held = 7 * 2 * 838_860_800 if delayed else 0
    assert phase.activations == (end_of_forward_bytes(cfg, 0) - last_stage_extra_bytes(cfg) - freed + held)


def test_the_time_model_moves_each_experts_wgrad_to_one_gemm_over_the_steps_rows():
    """No expert wgrad in the micro-batch's backward; after it, for each of the 2 x 8 experts, fc2's and then fc1's
    held operands concatenated and their wgrad with k = 8 x 1,024 rows, priced as the step's own term before the
    optimizer."""
    cfg = parse_args(MIXTRAL.split())
    backward = [w.op.name for w in chunk_backward(cfg, 0, 0)]
    assert not [n for n in backward if n.startswith("linear_fc") and n.endswith(".wgrad")]
    flush = delayed_expert_wgrad(cfg, 0)
    assert [w.op.name for w in flush] == [DELAYED_CAT, "linear_fc2.wgrad", DELAYED_CAT, "linear_fc1.wgrad"] * 16
    assert {dict(w.op.dims)["k"] for w in flush if w.op.name != DELAYED_CAT} == {8 * 1024}
    fc2_cat, _, fc1_cat, _ = flush[:4]  # each concatenation reads and writes its [M, out + in] operands once
    assert bytes_moved(fc2_cat.op, 2, 4) == 2 * 2 * 8192 * (4096 + 14336)
    assert bytes_moved(fc1_cat.op, 2, 4) == 2 * 2 * 8192 * (2 * 14336 + 4096)
    step = Pricing(load_hardware("H200")).predict(cfg)
    assert step.terms["delayed expert weight gradients"] > 0
    plain = Pricing(load_hardware("H200")).predict(parse_args(MIXTRAL.replace(" --moe-delay-expert-wgrad", "").split()))
    assert plain.terms["delayed expert weight gradients"] == 0


def test_backward_over_forward_leaves_out_the_delayed_wgrads():
    """The textbook 2 (dgrad and wgrad per forward GEMM) less the experts' wgrads the backward no longer runs: per
    micro-batch 2 layers x 8,192 rows x 2 x 4,096 x (2 x 14,336 + 14,336) FLOPs, the experts' forward GEMMs."""
    cfg = parse_args(MIXTRAL.split())
    experts = 2 * 8192 * 2 * 4096 * (2 * 14336 + 14336)
    forward = sum(w.op.flops for w in chunk_forward(cfg, 0, 0) if isinstance(w.op, Kernel))
    assert delayed_share(cfg, 0) == pytest.approx(experts / forward, rel=1e-12)
    assert 0.7 < delayed_share(cfg, 0) < 0.8
    assert delayed_share(parse_args(MIXTRAL.replace(" --moe-delay-expert-wgrad", "").split()), 0) == 0.0
