"""The MoE layer on one process (EP = 1): the router's top-k and renormalisation, the load-balancing loss, the
capacity and which assignments it drops, all derived by hand; the whole layer against a naive loop over tokens
(outputs and gradients); the routing counts of the step record (recompute's re-run not counted); a tiny MoE model
trains. Multi-process EP parity: tests/test_moe_parity.py.
"""
import math

import pytest
import torch

from common.arguments import parse_args
from common.config import ModelConfig
from engine.tensor_parallel.mappings import TPGroup
from engine.transformer.moe.expert_parallel import EPGroup
from engine.transformer.moe.moe_layer import MoEContext, MoELayer
from engine.transformer.moe.router import (
    TopKRouter,
    expert_capacity,
    load_balancing_loss,
)
from probes.probe_set import NullProbeSet
from tests.support.gloo import world_of_one
from tests.support.parity import train_and_collect

TP1 = TPGroup(group=None, size=1, rank=0)


def moe_config(**overrides) -> ModelConfig:
    fields = dict(num_layers=2, hidden_size=4, ffn_hidden_size=8, num_attention_heads=1, num_query_groups=1,
                  vocab_size=16, seq_length=4, max_position_embeddings=4, num_experts=4, moe_router_topk=2)
    return ModelConfig(**{**fields, **overrides})


def identity_router(config: ModelConfig, num_microbatches: int = 1) -> TopKRouter:
    """A router whose logits are its input (weight = I, h = E = 4): hand-made logits go in as tokens."""
    router = TopKRouter(config, "decoder.layers.0.mlp.router", num_microbatches=num_microbatches,
                        params_dtype=torch.float32, device="cpu", seed=1)
    with torch.no_grad():
        router.weight.copy_(torch.eye(4))
    return router


def test_router_takes_the_top_k_logits_and_softmaxes_over_the_k_chosen():
    routing = identity_router(moe_config())(torch.tensor([[3.0, 1.0, 2.0, 0.0], [0.0, 5.0, -1.0, 4.0]]))
    assert routing.experts.tolist() == [[0, 2], [1, 3]]
    # softmax over the two chosen logits only, 3 and 2 (resp. 5 and 4): e / (1 + e) and 1 / (1 + e)
    e = math.e
    torch.testing.assert_close(routing.probs, torch.tensor([[e / (1 + e), 1 / (1 + e)]] * 2))
    assert routing.tokens_per_expert.tolist() == [1, 1, 1, 1]
    assert routing.kept.all() and routing.dropped_per_expert.tolist() == [0, 0, 0, 0]


def test_load_balancing_loss_is_coeff_e_sum_f_p():
    """Two tokens with logits ln(4, 1, 2, 1): softmax (4, 1, 2, 1) / 8 each, both route to experts 0 and 2.
    f = (2, 0, 2, 0) / (T k = 4); P = (4, 1, 2, 1) / 8; loss = coeff x 4 x (1/2 x 1/2 + 1/2 x 1/4) = 1.5 coeff."""
    logits = torch.log(torch.tensor([[4.0, 1.0, 2.0, 1.0]] * 2))
    coeff = 0.01
    routing = identity_router(moe_config(moe_aux_loss_coeff=coeff))(logits)
    assert routing.tokens_per_expert.tolist() == [2, 0, 2, 0]
    assert routing.aux_loss.item() == pytest.approx(1.5 * coeff, rel=1e-6)
    # uniform routing probabilities give coeff whatever the counts (sum_e f_e = 1)
    assert load_balancing_loss(torch.zeros(5, 4), torch.tensor([3, 3, 2, 2]), 2, coeff).item() == pytest.approx(coeff)


def test_load_balancing_loss_adds_its_gradient_scaled_by_the_micro_batch_count_but_not_to_the_output():
    """The schedule divides each micro-batch's lm loss by m: the aux loss's gradient is scaled by 1/m alike, and the
    layer's output (hence the reported lm loss) is the same with or without the coefficient."""
    x = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    m, coeff = 4, 0.1
    grads, outputs = {}, {}
    for c in (0.0, coeff):
        router = identity_router(moe_config(moe_aux_loss_coeff=c), num_microbatches=m)
        routing = router(x)
        (routing.probs * torch.arange(2.0)).sum().backward()  # some loss of the probabilities
        grads[c], outputs[c] = router.weight.grad, routing.probs.detach()
    assert torch.equal(outputs[0.0], outputs[coeff])
    weight = torch.eye(4, requires_grad=True)
    counts = torch.bincount(torch.topk(x @ weight.detach().t(), 2).indices.reshape(-1), minlength=4)
    (aux_grad,) = torch.autograd.grad(load_balancing_loss(x @ weight.t(), counts, 2, coeff), weight)
    torch.testing.assert_close(grads[coeff] - grads[0.0], aux_grad / m)


def test_capacity_keeps_the_highest_probability_assignments():
    """capacity = ceil(T k / E x c) = ceil(4 x 2 / 4 x 0.5) = 1 assignment per expert. Chosen (expert: prob):
    t0 (0: s(1), 1: 1 - s(1)), t1 (0: s(3), 2: 1 - s(3)), t2 (0: s(0.5), 3: 1 - s(0.5)), t3 (2: s(1), 1: 1 - s(1))
    with s the logistic function (softmax over two logits). Expert 0 keeps t1 (s(3) the highest), expert 1 has a
    tie between t0 and t3 and keeps the earlier token t0, expert 2 keeps t3 (s(1) > 1 - s(3)), expert 3 keeps t2."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -5.0], [3.0, -5.0, 0.0, -5.0], [1.0, -5.0, -5.0, 0.5],
                           [-5.0, 0.0, 1.0, -5.0]])
    assert expert_capacity(4, 2, 4, 0.5) == 1
    routing = identity_router(moe_config(moe_expert_capacity_factor=0.5))(logits)
    assert routing.experts.tolist() == [[0, 1], [0, 2], [0, 3], [2, 1]]
    assert routing.kept.tolist() == [[False, True], [True, False], [False, True], [True, False]]
    assert routing.tokens_per_expert.tolist() == [3, 2, 2, 1]
    assert routing.dropped_per_expert.tolist() == [2, 1, 1, 0]
    assert expert_capacity(4, 2, 4, 2.0) == 4  # no expert can get more than T = 4: nothing drops
    assert identity_router(moe_config(moe_expert_capacity_factor=2.0))(logits).kept.all()


def naive_moe(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """The layer's definition token by token: each kept assignment's expert output, weighted by its probability."""
    tokens = x.reshape(-1, x.shape[-1])
    routing = layer.router(tokens)
    experts = dict(layer.experts.named_children())
    rows = []
    for t in range(tokens.shape[0]):
        out = torch.zeros(tokens.shape[-1])
        for slot in range(routing.experts.shape[1]):
            if routing.kept[t, slot]:
                out = out + routing.probs[t, slot] * experts[str(routing.experts[t, slot].item())](tokens[t:t + 1])[0]
        rows.append(out)
    return torch.stack(rows).view_as(x)


@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_moe_layer_equals_a_loop_over_tokens_outputs_and_gradients(capacity_factor):
    config = moe_config(hidden_size=8, num_experts=4, moe_router_topk=2, moe_aux_loss_coeff=0.01,
                        moe_expert_capacity_factor=capacity_factor, init_method_std=0.5)
    layer = MoELayer(config, 0, moe=MoEContext(EPGroup(group=None, size=1, rank=0), num_microbatches=2), tp=TP1,
                     params_dtype=torch.float32, device="cpu", seed=3)
    x = torch.randn(6, 2, 8, generator=torch.Generator().manual_seed(1))
    results = []
    for run in (layer, lambda h: naive_moe(layer, h)):
        layer.zero_grad()
        inp = x.clone().requires_grad_()
        out = run(inp)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        results.append((out.detach(), inp.grad, {n: p.grad.clone() for n, p in layer.named_parameters()}))
    (out, dx, grads), (ref_out, ref_dx, ref_grads) = results
    if capacity_factor is not None:
        assert layer.router(x.view(-1, 8)).dropped_per_expert.sum() > 0, "the case must drop something"
    torch.testing.assert_close(out, ref_out, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dx, ref_dx, rtol=1e-6, atol=1e-6)
    assert grads.keys() == ref_grads.keys() and len(grads) == 1 + 4 * 2  # router, 4 experts x (fc1, fc2)
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], rtol=1e-5, atol=1e-6, msg=name)


def test_expert_parameters_are_named_and_seeded_by_global_expert_and_marked_for_expert_reduction():
    config = moe_config(num_experts=4, moe_ffn_hidden_size=6)  # experts narrower than the dense f = 8
    full = MoELayer(config, 1, moe=MoEContext(EPGroup(None, 1, 0)), tp=TP1, params_dtype=torch.float32,
                    device="cpu", seed=5)
    second_half = MoELayer(config, 1, moe=MoEContext(EPGroup(None, 2, 1)), tp=TP1, params_dtype=torch.float32,
                           device="cpu", seed=5)
    names = dict(second_half.named_parameters())
    assert sorted(names) == ["experts.2.linear_fc1.weight", "experts.2.linear_fc2.weight",
                             "experts.3.linear_fc1.weight", "experts.3.linear_fc2.weight", "router.weight"]
    assert names["experts.2.linear_fc1.weight"].shape == (2 * 6, 4)  # [gate; up] of width moe_ffn_hidden_size
    assert names["experts.2.linear_fc2.weight"].shape == (4, 6) and names["router.weight"].shape == (4, 4)
    full_params = dict(full.named_parameters())
    for name, param in names.items():
        assert torch.equal(param, full_params[name]), name
        assert getattr(param, "allreduce", True) is (name == "router.weight"), name


class StepFigures(NullProbeSet):
    """Probes that keep what the training loop reports per step."""

    def __init__(self):
        self.steps = []

    def step_end(self, iteration, **figures):
        self.steps.append(figures)


def tiny_moe_flags(*extra: str) -> list[str]:
    return ["--model", "tiny", "--num-layers", "2", "--micro-batch-size", "2", "--global-batch-size", "8",
            "--mock-data", "--num-experts", "4", "--moe-router-topk", "2", *extra]


def train_tiny(flags: list[str]):
    probes = StepFigures()
    with world_of_one():
        result = train_and_collect(parse_args(flags, world_size=1), probes=probes)
    return result, probes.steps


def test_step_record_counts_each_assignment_once_recompute_included():
    """Per step, every layer's router makes T k = (seq 32 x micro-batch 2) x 2 assignments in each of the 4
    micro-batches: 512. Full recompute runs each layer's forward again in backward; that re-run is not counted,
    so the counts equal the run without recompute. A capacity factor of 0.5 drops some, counted apart."""
    plain = train_tiny(tiny_moe_flags("--train-iters", "2", "--moe-expert-capacity-factor", "0.5",
                                      "--moe-aux-loss-coeff", "0.01"))[1]
    recomputed = train_tiny(tiny_moe_flags("--train-iters", "2", "--moe-expert-capacity-factor", "0.5",
                                           "--moe-aux-loss-coeff", "0.01", "--recompute-granularity", "full",
                                           "--recompute-method", "uniform", "--recompute-num-layers", "1"))[1]
    for step in plain:
        assert step["moe_tokens_per_expert"].keys() == {"0", "1"}
        for layer, tokens in step["moe_tokens_per_expert"].items():
            assert len(tokens) == 4 and sum(tokens) == 32 * 2 * 2 * 4
            dropped = step["moe_dropped_tokens"][layer]
            # capacity per expert per micro-batch: ceil(64 x 2 / 4 x 0.5) = 16, 4 micro-batches
            assert all(t - d <= 16 * 4 for t, d in zip(tokens, dropped))
        assert sum(sum(d) for d in step["moe_dropped_tokens"].values()) > 0
        assert 2 * 0.01 * 0.9 < step["moe_aux_loss"] < 2 * 0.01 * 4  # two layers, each >= ~coeff, <= E coeff
    assert [s["moe_tokens_per_expert"] for s in recomputed] == [s["moe_tokens_per_expert"] for s in plain]
    assert [s["moe_dropped_tokens"] for s in recomputed] == [s["moe_dropped_tokens"] for s in plain]
    assert [s["moe_aux_loss"] for s in recomputed] == pytest.approx([s["moe_aux_loss"] for s in plain], rel=1e-6)


def test_sequential_experts_record_the_rows_their_gemms_ran_in_each_forward():
    """Each of a step's 4 micro-batch forwards (full recompute's re-run not counted) gives each of the 4 experts its
    routed rows: T k = 32 x 2 x 2 = 128 a forward, summing over the forwards to the step's tokens per expert (no
    capacity, EP 1). Padded to 16, each expert's rows are a multiple of 16, fewer than 16 over its routed count. Grouped
    experts' rows never reach the host: no record."""
    recompute = ("--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1")
    for step in train_tiny(tiny_moe_flags("--train-iters", "2", *recompute))[1]:
        assert step["moe_expert_rows"].keys() == {"0", "1"}
        for layer, forwards in step["moe_expert_rows"].items():
            assert len(forwards) == 4 and all(len(f) == 4 and sum(f) == 128 for f in forwards)
            assert [sum(e) for e in zip(*forwards)] == step["moe_tokens_per_expert"][layer]
    for step in train_tiny(tiny_moe_flags("--train-iters", "1", "--moe-pad-expert-rows", "16"))[1]:
        for layer, forwards in step["moe_expert_rows"].items():
            assert all(r % 16 == 0 for f in forwards for r in f)
            assert all(128 <= sum(f) < 128 + 4 * 16 for f in forwards)  # each expert pads fewer than 16 rows
    assert "moe_expert_rows" not in train_tiny(tiny_moe_flags("--train-iters", "1", "--moe-grouped-gemm"))[1][0]


def test_dense_model_reports_no_moe_figures():
    _, steps = train_tiny(["--model", "tiny", "--num-layers", "1", "--micro-batch-size", "2",
                           "--global-batch-size", "2", "--mock-data", "--train-iters", "1"])
    assert not any(key.startswith("moe_") for key in steps[0])


def test_tiny_moe_model_trains():
    result, steps = train_tiny(tiny_moe_flags("--train-iters", "20", "--lr", "1e-2", "--min-lr", "1e-3",
                                              "--lr-warmup-iters", "2", "--moe-aux-loss-coeff", "0.01"))
    losses = result["losses"]
    assert sum(losses[-5:]) / 5 < losses[0] - 0.1, losses
    assert all(sum(d) == 0 for s in steps for d in s["moe_dropped_tokens"].values())  # no capacity: no drops
