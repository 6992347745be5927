"""Tensor-parallel layers against single-device oracles (F.linear, F.embedding, F.cross_entropy) on gloo ranks.

Every rank builds the same inputs and the same full weight (the layer's own seeded master weight, drawn again
here), runs the oracle on the full tensors, and checks that its TP layer produces the oracle's output slice, the
oracle's input gradient (slice), and the oracle's weight gradient restricted to the rank's weight slice. The loss
is sum(out * g) for a fixed random g, so dL/d(out) = g and each expectation follows from the chain rule.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from engine.parallel_state import ParallelState
from engine.tensor_parallel import mappings
from engine.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from engine.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    pad_vocab_size,
)
from engine.tensor_parallel.mappings import TPGroup
from engine.tensor_parallel.random import MasterWeightInit, partition
from tests.support.gloo import run_distributed
from tests.support.recording_probes import RangeLog

S, B, IN, OUT = 8, 2, 12, 16
STD = 0.5



def _tp_group(probes) -> TPGroup:
    return TPGroup.from_parallel_state(ParallelState.initialize(tp=dist.get_world_size()), probes)


def _close(actual, expected, what):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what}: {m}")


def _inputs(*shape, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g)


def _check_column(tp: TPGroup, sequence_parallel: bool, gather_output: bool) -> None:
    r, n = tp.rank, tp.size
    init = MasterWeightInit(STD, 7, "col.weight")
    layer = ColumnParallelLinear(IN, OUT, tp=tp, init=init, params_dtype=torch.float32, device="cpu",
                                 gather_output=gather_output, sequence_parallel=sequence_parallel)
    w = init.draw((OUT, IN), torch.device("cpu")).requires_grad_()
    x_full = _inputs(S, B, IN, seed=1).requires_grad_()
    g = _inputs(S, B, OUT, seed=2)
    (F.linear(x_full, w) * g).sum().backward()
    rows = slice(r * OUT // n, (r + 1) * OUT // n)
    seq = slice(r * S // n, (r + 1) * S // n)
    what = f"column sp={sequence_parallel} gather={gather_output}"
    _close(layer.weight.detach(), w.detach()[rows], f"{what} weight slice")

    x = x_full.detach()[seq] if sequence_parallel else x_full.detach()
    x.requires_grad_()
    out = layer(x)
    expected_out = F.linear(x_full.detach(), w.detach())
    g_local = g if gather_output else g[..., rows]
    _close(out, expected_out if gather_output else expected_out[..., rows], f"{what} output")
    # gather_output: the output is replicated and so is the loss (Megatron's convention: each rank backpropagates
    # the same full loss); without it each rank's loss covers its own columns and the losses add up.
    (out * g_local).sum().backward()
    _close(x.grad, x_full.grad[seq] if sequence_parallel else x_full.grad, f"{what} input grad")
    _close(layer.weight.grad, w.grad[rows], f"{what} weight grad")
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 0


def _check_row(tp: TPGroup, sequence_parallel: bool, input_is_parallel: bool) -> None:
    r, n = tp.rank, tp.size
    init = MasterWeightInit(STD, 7, "row.weight")
    layer = RowParallelLinear(IN, OUT, tp=tp, init=init, params_dtype=torch.float32, device="cpu",
                              input_is_parallel=input_is_parallel, sequence_parallel=sequence_parallel)
    w = init.draw((OUT, IN), torch.device("cpu")).requires_grad_()
    x_full = _inputs(S, B, IN, seed=3).requires_grad_()
    g = _inputs(S, B, OUT, seed=4)
    (F.linear(x_full, w) * g).sum().backward()
    cols = slice(r * IN // n, (r + 1) * IN // n)
    seq = slice(r * S // n, (r + 1) * S // n)
    what = f"row sp={sequence_parallel} input_is_parallel={input_is_parallel}"

    x = (x_full.detach()[..., cols] if input_is_parallel else x_full.detach()).requires_grad_()
    out = layer(x)
    expected_out = F.linear(x_full.detach(), w.detach())
    _close(out, expected_out[seq] if sequence_parallel else expected_out, f"{what} output")
    if sequence_parallel:  # each rank owns a slice of the sequence: the per-rank losses add up to the full loss
        (out * g[seq]).sum().backward()
    else:  # the output is replicated: every rank's loss is the full loss
        (out * g).sum().backward()
    _close(x.grad, x_full.grad[..., cols] if input_is_parallel else x_full.grad, f"{what} input grad")
    _close(layer.weight.grad, w.grad[:, cols], f"{what} weight grad")
    assert layer.weight.tensor_model_parallel and layer.weight.partition_dim == 1


def _check_embedding(tp: TPGroup, sequence_parallel: bool) -> None:
    r, n = tp.rank, tp.size
    vocab = 10
    padded = pad_vocab_size(vocab, 3, n)
    init = MasterWeightInit(STD, 7, "emb.weight", valid_rows=vocab)
    layer = VocabParallelEmbedding(padded, IN, tp=tp, init=init, params_dtype=torch.float32, device="cpu",
                                   reduce_scatter_embeddings=sequence_parallel)
    table = init.draw((padded, IN), torch.device("cpu")).requires_grad_()
    ids = torch.randint(0, vocab, (B, S), generator=torch.Generator().manual_seed(5))
    g = _inputs(S, B, IN, seed=6)
    (F.embedding(ids.t(), table) * g).sum().backward()
    rows = slice(r * padded // n, (r + 1) * padded // n)
    seq = slice(r * S // n, (r + 1) * S // n)
    what = f"embedding sp={sequence_parallel}"

    out = layer(ids)
    expected = F.embedding(ids.t(), table.detach())
    _close(out, expected[seq] if sequence_parallel else expected, f"{what} output [s, b, h]")
    (out * (g[seq] if sequence_parallel else g)).sum().backward()
    _close(layer.weight.grad, table.grad[rows], f"{what} weight grad")


def _check_cross_entropy(tp: TPGroup) -> None:
    r, n = tp.rank, tp.size
    vocab = 10
    padded = pad_vocab_size(vocab, 3, n)
    logits_full = _inputs(S, B, padded, seed=8)
    logits_full[..., vocab:] = 50.0  # padding columns that would dominate the softmax if they were not masked
    target = torch.randint(0, vocab, (S, B), generator=torch.Generator().manual_seed(9))
    g = _inputs(S, B, seed=10)
    oracle_logits = logits_full.clone().requires_grad_()
    oracle = F.cross_entropy(oracle_logits[..., :vocab].reshape(-1, vocab), target.reshape(-1),
                             reduction="none").view(S, B)
    (oracle * g).sum().backward()
    cols = slice(r * padded // n, (r + 1) * padded // n)

    local = logits_full[..., cols].clone().requires_grad_()
    before = local.detach().clone()
    loss = vocab_parallel_cross_entropy(local, target, tp, vocab)
    assert loss.dtype == torch.float32 and loss.shape == (S, B)
    _close(loss, oracle.detach(), "cross entropy loss")
    _close(local.detach(), before, "cross entropy leaves its input unchanged")
    (loss * g).sum().backward()  # the loss is replicated; each rank's logits get their columns of the gradient
    _close(local.grad, oracle_logits.grad[..., cols], "cross entropy logits grad")


def _all_layers(rank: int, world_size: int) -> list[tuple[str, str]]:
    torch.manual_seed(0)
    probes = RangeLog()
    tp = _tp_group(probes)
    for sp in (False, True):
        _check_column(tp, sp, gather_output=False)
        _check_row(tp, sp, input_is_parallel=True)
        _check_embedding(tp, sp)
    _check_column(tp, False, gather_output=True)
    _check_row(tp, False, input_is_parallel=False)
    _check_cross_entropy(tp)
    return probes.ranges


@pytest.mark.slow
@pytest.mark.parametrize("tp", [2, 4])
def test_parallel_layers_match_single_device_oracles(tp):
    ranges = run_distributed(_all_layers, tp)[0]
    categories = {category for _, category in ranges}
    assert categories == {"tp-comm"}
    names = {name for name, _ in ranges}
    for collective in ("tp all-reduce", "sp all-gather", "sp reduce-scatter", "tp all-gather",
                       "sp all-gather (linear bwd)", "sp reduce-scatter (linear bwd)", "tp all-reduce (copy bwd)",
                       "tp all-reduce (ce max)", "tp all-reduce (ce sums)"):
        assert collective in names, f"no probes range for {collective}: {sorted(names)}"


def test_tp_size_one_is_plain_pytorch_and_issues_no_collective():
    probes = RangeLog()
    tp = TPGroup(group=None, size=1, rank=0, probes=probes)  # no process group at all: nothing may use one
    init = MasterWeightInit(STD, 7, "col.weight")
    layer = ColumnParallelLinear(IN, OUT, tp=tp, init=init, params_dtype=torch.float32, device="cpu",
                                 sequence_parallel=True)
    x = _inputs(S, B, IN, seed=1)
    torch.testing.assert_close(layer(x), F.linear(x, init.draw((OUT, IN), torch.device("cpu"))))
    for fn in (mappings.copy_to_tensor_model_parallel_region, mappings.reduce_from_tensor_model_parallel_region,
               mappings.scatter_to_tensor_model_parallel_region, mappings.gather_from_tensor_model_parallel_region,
               mappings.reduce_scatter_to_sequence_parallel_region):
        assert fn(x, tp) is x
    assert probes.ranges == []


def test_pad_vocab_size_rounds_up_to_divisible_by_times_tp():
    assert pad_vocab_size(50257, 128, 1) == 393 * 128  # GPT-2's vocab: 50304
    assert pad_vocab_size(128256, 128, 2) == 128256  # 128256 = 501 x 256: no padding
    assert pad_vocab_size(128256, 128, 8) == 126 * 1024
    assert pad_vocab_size(1000, 8, 3) == 42 * 24


def test_partition_with_stride_gives_each_rank_its_slice_of_every_fused_part():
    gate = torch.arange(8.0).view(8, 1)
    up = 100 + torch.arange(8.0).view(8, 1)
    fused = torch.cat((gate, up))
    for rank in range(4):
        expected = torch.cat((gate[2 * rank:2 * rank + 2], up[2 * rank:2 * rank + 2]))
        torch.testing.assert_close(partition(fused, 0, 2, rank, 4), expected)


def test_master_weight_depends_on_name_and_seed_only():
    a = MasterWeightInit(0.02, 1234, "decoder.layers.3.mlp.linear_fc1.weight").draw((4, 3), torch.device("cpu"))
    again = MasterWeightInit(0.02, 1234, "decoder.layers.3.mlp.linear_fc1.weight").draw((4, 3), torch.device("cpu"))
    other_layer = MasterWeightInit(0.02, 1234, "decoder.layers.2.mlp.linear_fc1.weight").draw((4, 3),
                                                                                               torch.device("cpu"))
    other_seed = MasterWeightInit(0.02, 1235, "decoder.layers.3.mlp.linear_fc1.weight").draw((4, 3),
                                                                                              torch.device("cpu"))
    assert torch.equal(a, again)
    assert not torch.equal(a, other_layer) and not torch.equal(a, other_seed)
    padded = MasterWeightInit(0.02, 1234, "emb", valid_rows=3).draw((5, 2), torch.device("cpu"))
    unpadded = MasterWeightInit(0.02, 1234, "emb").draw((3, 2), torch.device("cpu"))
    torch.testing.assert_close(padded[:3], unpadded)
    assert torch.count_nonzero(padded[3:]) == 0
