"""--moe-pad-expert-rows N: SequentialMLP runs each expert on its rows padded with zero rows to a multiple of N.

The zero rows' outputs are dropped, so the layer's outputs and every gradient are the unpadded layer's (fp32, CPU,
1e-5), a training run on a world of one is the unpadded run, every expert GEMM sees a multiple of N rows, and the
ledger's formulas count the padded rows (uniform routing: T k / E rows an expert, rounded up). Why it exists: on an
H200 cuBLAS chose a kernel on the host for 4-7 ms at some small row counts it had not seen, while the GPU idled
(tests/fixtures/h200_moe/README.md).
"""
from __future__ import annotations

import pytest
import torch

from cli.main import main as cli
from common.arguments import parse_args
from common.ops import layer_ops
from common.ops.shapes import ExpertShapes, Shapes
from engine.tensor_parallel.mappings import TPGroup
from engine.transformer.moe.expert_parallel import EPGroup
from engine.transformer.moe.moe_layer import MoEContext, MoELayer
from ledger.models.formulas.activations import moe_saved_tensors
from ledger.models.time_model import host_recipe as recipe
from ledger.models.time_model.ops import Work
from tests.support.parity import assert_flags_change_no_training

MOE = "--model tiny --num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 0.01 --seq-length 32 --micro-batch-size 2"


def _layer(pad: int | None):
    cfg = parse_args((MOE + (f" --moe-pad-expert-rows {pad}" if pad else "")).split())
    layer = MoELayer(cfg.model, 0, moe=MoEContext(ep=EPGroup(None, 1, 0)), tp=TPGroup(None, 1, 0),
                     params_dtype=torch.float32, device="cpu", seed=3)
    rows = []
    for expert in layer.experts.children():
        expert.linear_fc1.register_forward_pre_hook(lambda _m, args: rows.append(args[0].shape[0]))
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(32, 2, 64, generator=gen, requires_grad=True)
    y = layer(x)
    y.backward(torch.randn(y.shape, generator=gen))
    return layer, y.detach(), x.grad, {n: p.grad for n, p in layer.named_parameters()}, rows


def test_padded_experts_give_the_unpadded_outputs_and_gradients_and_gemms_see_multiples():
    plain, padded = _layer(None), _layer(24)
    counts = plain[0].record.tokens.tolist()
    assert padded[0].record.tokens.tolist() == counts and any(c % 24 for c in counts)  # some expert is padded
    assert padded[4] == [-(-c // 24) * 24 for c in counts if c] and sum(padded[4]) > sum(counts)
    for got, expected in zip(padded[1:3], plain[1:3]):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    for name, grad in padded[3].items():
        torch.testing.assert_close(grad, plain[3][name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_a_training_run_with_padded_experts_is_the_unpadded_run():
    base = ["--model", "tiny", "--num-layers", "2", "--micro-batch-size", "1", "--global-batch-size", "4",
            "--train-iters", "4", "--lr", "3e-3", "--clip-grad", "0.05", "--mock-data", "--num-experts", "4",
            "--moe-router-topk", "2", "--moe-aux-loss-coeff", "0.01"]
    assert_flags_change_no_training(base, ["--moe-pad-expert-rows", "16"])


def test_the_formulas_count_each_experts_padded_rows():
    """T = 64 tokens x top-2 = 128 assignments, 32 an expert under uniform routing: padded to 24, 48 each (192
    rows); to 16 (a divisor), unchanged. The dispatch's row index stays at the 128 assignments."""
    for pad, rows in ((None, 128), (16, 128), (24, 192)):
        cfg = parse_args((MOE + (f" --moe-pad-expert-rows {pad}" if pad else "")).split())
        saved = moe_saved_tensors(cfg)
        assert ExpertShapes.of(cfg).rows == (rows // 4,) * 4
        assert saved["experts.linear_fc1.input"] == 4 * rows * 64  # fp32 (tiny without --bf16), h 64
        assert saved["dispatch.row_index[int64]"] == 8 * 128


@pytest.mark.parametrize("value, problem", [("0", "must be in [1, 4096], got 0"), ("-8", "got -8"),
                                            ("100000", "got 100000")])
def test_a_bad_multiple_is_one_line_and_exit_2(capsys, value, problem):
    code = cli(["plan", *MOE.split(), "--moe-pad-expert-rows", value])
    err = capsys.readouterr().err
    assert code == 2 and problem in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_the_host_timeline_prices_each_experts_pad_and_its_backward():
    """The host recipes of a padded MoE model add, per expert and micro-batch, F.pad and the output's slice to the
    forward (fc1's entry) and their two autograd nodes to the backward (fc1's dgrad); an unpadded model, a dense one
    and a multiple of 1 (nothing to pad) add nothing."""
    cfg = parse_args((MOE + " --moe-pad-expert-rows 16").split())
    expert = layer_ops(Shapes.of(cfg)).moe.experts[0][1]
    fprop, dgrad = Work(expert.fc1.fprop, "layers"), Work(expert.fc1.dgrad, "layers")
    for w, forward, pad in ((fprop, True, recipe.PAD_ROWS_FWD), (dgrad, False, recipe.PAD_ROWS_BWD)):
        plain, padded = recipe.entry(w, forward), recipe.entry(w, forward, padded_experts=True)
        assert {k: padded[k] - plain.get(k, 0) for k in padded if padded[k] != plain.get(k, 0)} == pad
    assert recipe.PAD_ROWS_FWD == {"eager": 1, "launch": 1, "view": 1}
    assert recipe.PAD_ROWS_BWD == {"autograd_node": 2, "eager_backward": 2, "launch": 1}
