"""The output layer fused into the loss over chunks of tokens (--cross-entropy-loss-fusion --cross-entropy-fusion-impl
linear, engine/fusions/fused_linear_cross_entropy.py) gives the unchunked path's loss and gradients, fp32, to 1e-5:
the function alone (chunks that do and do not divide the tokens, padded vocabulary columns), its weight gradient
added into a DDP main_grad, the whole model (tied and untied), a training run, and on gloo at TP 2 with and without
sequence parallelism. What it no longer holds (the [s, b, V/t] logits) is the ledger's: tests/test_formulas.py.
"""
from __future__ import annotations

import pytest
import torch

from common.arguments import parse_args
from common.config import PRESETS, ModelConfig
from engine.fusions import fused_linear_cross_entropy as fused
from engine.fusions.fused_linear_cross_entropy import LinearCrossEntropyModule, linear_cross_entropy
from engine.models.gpt_model import GPTModel
from engine.parallel_state import ParallelState
from engine.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from engine.tensor_parallel.layers import ColumnParallelLinear
from engine.tensor_parallel.mappings import TPGroup
from engine.tensor_parallel.random import MasterWeightInit
from tests.support.gloo import run_distributed
from tests.support.parity import assert_flags_change_no_training, train_and_collect

TP1 = TPGroup(None, 1, 0)
S, B, H, VOCAB, PADDED = 16, 2, 12, 40, 48  # 8 padding columns the loss must ignore
LINEAR = ["--cross-entropy-loss-fusion", "--cross-entropy-fusion-impl", "linear"]


def _inputs(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, B, H, generator=gen)
    weight = torch.randn(PADDED, H, generator=gen)
    weight[VOCAB:] = 3.0  # trained padding rows would win every softmax if they counted
    return hidden, weight, torch.randint(0, VOCAB, (S, B), generator=gen)


def _unchunked(hidden, weight, target, g):
    layer = ColumnParallelLinear(H, PADDED, tp=TP1, init=MasterWeightInit(0.02, 1, "w"), params_dtype=torch.float32,
                                 device="cpu")
    with torch.no_grad():
        layer.weight.copy_(weight)
    x = hidden.clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(layer(x), target, TP1, VOCAB)
    (loss * g).sum().backward()
    return loss.detach(), x.grad, layer.weight.grad


@pytest.mark.parametrize("chunk", [1, 5, 32, 2048])
def test_chunked_loss_and_gradients_equal_the_unchunked_path(monkeypatch, chunk):
    """32 tokens in chunks of 1, of 5 (the last one of 2), one chunk, one chunk larger than the tokens; a per-token
    upstream gradient g, so that each token's gradient is scaled by its own factor."""
    monkeypatch.setattr(fused, "CHUNK_TOKENS", chunk)
    hidden, weight, target = _inputs()
    g = torch.rand(S, B, generator=torch.Generator().manual_seed(9))
    expected_loss, expected_dx, expected_dw = _unchunked(hidden, weight, target, g)
    x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = linear_cross_entropy(x, w, target, TP1, VOCAB)
    (loss * g).sum().backward()
    assert loss.shape == (S, B) and loss.dtype == torch.float32
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(x.grad, expected_dx, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(w.grad, expected_dw, rtol=1e-5, atol=1e-7)
    assert w.grad[VOCAB:].abs().max() == 0  # a padded column takes no probability, so gets no gradient


def test_the_weight_gradient_goes_into_main_grad_as_the_fused_linear_puts_it(monkeypatch):
    """Under DDP (main_grad, the grad_added_to_main_grad flag) two micro-batches add their weight gradients into the
    fp32 main_grad, chunk by chunk; autograd gets a placeholder, which DDP's hook drops (tensor_parallel/layers.py)."""
    monkeypatch.setattr(fused, "CHUNK_TOKENS", 7)
    weight = torch.nn.Parameter(_inputs()[1])
    weight.main_grad = torch.zeros_like(weight)
    weight.grad_added_to_main_grad = False
    expected = torch.zeros_like(weight)
    for seed in (1, 2):
        hidden, _, target = _inputs(seed)
        expected += _unchunked(hidden, weight.detach(), target, torch.ones(S, B))[2]
        weight.grad = None
        linear_cross_entropy(hidden, weight, target, TP1, VOCAB).sum().backward()
        assert weight.grad_added_to_main_grad
        weight.grad_added_to_main_grad = False  # DDP's hook clears it
    torch.testing.assert_close(weight.main_grad, expected, rtol=1e-5, atol=1e-6)


def _state() -> ParallelState:
    return ParallelState(rank=0, world_size=1, tp_size=1, pp_size=1, dp_size=1, cp_size=1, tp_rank=0, pp_rank=0,
                         dp_rank=0, cp_rank=0)


def _model_loss_and_grads(config: ModelConfig, parallel_state: ParallelState, sequence_parallel: bool = False,
                          seed: int = 0) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = GPTModel(config, parallel_state, pre_process=True, post_process=True,
                     layer_numbers=list(range(config.num_layers)), sequence_parallel=sequence_parallel,
                     params_dtype=torch.float32, device="cpu")
    ids = torch.randint(0, config.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(seed))
    loss = model(ids[:, :-1], ids[:, 1:])
    loss.mean().backward()
    return loss.detach(), {name: p.grad for name, p in model.named_parameters()}


def _assert_same_model_gradients(config: ModelConfig, parallel_state: ParallelState,
                                 sequence_parallel: bool = False) -> None:
    linear = ModelConfig(**{**config.__dict__, "cross_entropy_loss_fusion": True,
                            "cross_entropy_fusion_impl": "linear"})
    expected_loss, expected = _model_loss_and_grads(config, parallel_state, sequence_parallel)
    loss, grads = _model_loss_and_grads(linear, parallel_state, sequence_parallel)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=0)
    assert grads.keys() == expected.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected[name], rtol=1e-5, atol=1e-5 * expected[name].abs().max().item(),
                                   msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("untie", [False, True])
def test_the_model_with_the_fusion_has_the_unfused_models_loss_and_gradients(monkeypatch, untie):
    """The tiny model's 32 tokens in chunks of 5; tied, the output layer multiplies by the embedding's weight and
    both uses' gradients meet in it."""
    monkeypatch.setattr(fused, "CHUNK_TOKENS", 5)
    _assert_same_model_gradients(ModelConfig(**PRESETS["tiny"], untie_embeddings_and_output_weights=untie), _state())


def test_the_fused_loss_runs_inside_the_output_layer_module():
    """What hooks the output layer (DDP's wait for its all-gathered weight under --overlap-param-gather) must see it
    run: the loss is the output layer module's forward, once per micro-batch."""
    config = ModelConfig(**PRESETS["tiny"], cross_entropy_loss_fusion=True, cross_entropy_fusion_impl="linear")
    model = GPTModel(config, _state(), pre_process=True, post_process=True, layer_numbers=[0, 1],
                     sequence_parallel=False, params_dtype=torch.float32, device="cpu")
    assert isinstance(model.output_layer, LinearCrossEntropyModule)
    calls = []
    model.output_layer.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs.keys()),
                                                 with_kwargs=True)
    ids = torch.randint(0, config.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(0))
    assert model(ids[:, :-1], ids[:, 1:]).shape == (B, S)
    assert len(calls) == 1 and "labels" in calls[0]
    assert model(ids[:, :-1]).shape == (S, B, model.padded_vocab_size)  # without labels: the logits, as unfused


def test_a_training_run_with_the_fusion_is_the_unfused_run(monkeypatch):
    """Three steps of the whole loop on a world of one (DDP's fused main_grad accumulation, the optimizer, clipping):
    the same losses, grad norms and weights."""
    monkeypatch.setattr(fused, "CHUNK_TOKENS", 9)
    base = ["--model", "tiny", "--num-layers", "2", "--micro-batch-size", "2", "--global-batch-size", "4",
            "--train-iters", "3", "--lr", "3e-3", "--clip-grad", "0.05", "--mock-data"]
    # Adam divides each gradient by its running RMS, so a weight whose gradient is at rounding level moves by more
    # than the rounding: the weights agree to 1e-4 (6.6e-5 seen on one element of 22,528 on an AMD EPYC's kernels)
    assert_flags_change_no_training(base, LINEAR, param_rtol=1e-4, param_atol=1e-5)


@pytest.mark.slow
def test_compiled_as_on_gpu_it_gives_the_eager_numbers(monkeypatch):
    """The chunk passes compiled by inductor (engine/jit.py; on CPU here), four chunks of 8 tokens."""
    from engine import jit

    monkeypatch.setattr(fused, "CHUNK_TOKENS", 8)
    hidden, weight, target = _inputs()
    results = []
    for devices in (set(), {"cpu"}):
        monkeypatch.setattr(jit, "COMPILE_DEVICE_TYPES", devices)
        x, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        loss = linear_cross_entropy(x, w, target, TP1, VOCAB)
        loss.sum().backward()
        results.append((loss.detach(), x.grad, w.grad))
    for compiled, eager in zip(results[1], results[0]):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def _training_rank(rank: int, world_size: int, argv: list[str]) -> dict:
    fused.CHUNK_TOKENS = 9
    return train_and_collect(parse_args(argv, world_size=world_size))


@pytest.mark.slow
def test_tp2_dp2_with_overlapped_param_gather_trains_the_unfused_single_process_model():
    """World 4 (TP2 x DP2, SP, distributed optimizer, overlapped grad reduce and param gather: the output layer waits
    for its all-gathered weight in its module's pre-hook) with the fusion, against the unfused model on one process:
    tests/test_training_parity.py's bar (losses and grad norms to 1e-5)."""
    from tests.support.parity import assert_rank_matches, reference

    base = ("--model", "tiny", "--num-layers", "2", "--micro-batch-size", "1", "--global-batch-size", "8",
            "--train-iters", "4", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "2", "--clip-grad",
            "0.05", "--mock-data")
    flags = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer",
             "--overlap-grad-reduce", "--overlap-param-gather", "--ddp-bucket-size", "20000", *LINEAR]
    results = run_distributed(_training_rank, 4, [*base, *flags])
    ref = reference(base, 2)
    for rank, res in enumerate(results):
        assert_rank_matches(res, ref, rank)


def _tp2_rank(rank: int, world_size: int, sequence_parallel: bool) -> None:
    fused.CHUNK_TOKENS = 5
    state = ParallelState.initialize(tp=2)
    _assert_same_model_gradients(ModelConfig(**PRESETS["tiny"]), state, sequence_parallel)


@pytest.mark.slow
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_tp2_with_the_fusion_has_the_unfused_loss_and_gradients(sequence_parallel):
    """Each TP rank holds half the vocabulary: the per-chunk figures combine over TP in the unfused loss's two
    all-reduces; under SP the input is gathered and its gradient reduce-scattered. Every rank's loss and local
    gradients against the unfused model at TP 2."""
    run_distributed(_tp2_rank, 2, sequence_parallel)
