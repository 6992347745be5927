"""jit_fuser: which dimensions of a fused function's input the compiled graph treats as symbolic.

An MoE expert's SwiGLU sees a new row count every micro-batch, so its graph must be general in the rows; its width
(2 x the expert's FFN size) never changes, and must stay a constant: a kernel that splits rows at a symbolic width
divides by it per element. The graphs are captured with a recording dynamo backend (no inductor here): their
placeholders carry the symbolic shapes inductor would compile.
"""
from __future__ import annotations

import pytest
import torch

from engine import jit
from engine.transformer.mlp import _swiglu
from engine.transformer.moe.token_dispatcher import _unpermute, unpermute
from tests.support.compiled import compiled_as_on_gpu


@pytest.fixture
def graphs() -> list[list[tuple[bool, ...]]]:
    """Compile on CPU through a backend that records, per graph, each tensor input's dims as symbolic or not."""
    recorded: list[list[tuple[bool, ...]]] = []

    def recorder(gm, example_inputs):
        values = [node.meta.get("example_value") for node in gm.graph.nodes if node.op == "placeholder"]
        recorded.append([tuple(isinstance(d, torch.SymInt) for d in v.shape)
                         for v in values if isinstance(v, torch.Tensor)])
        return gm.forward

    with compiled_as_on_gpu(recorder):
        yield recorded


def test_an_expert_swiglu_compiles_once_for_every_row_count_with_its_width_a_constant(graphs):
    fused = jit.jit_fuser(_swiglu, dynamic_rows=True)
    for rows in (5, 7, 9, 300):
        x = torch.randn(rows, 64)
        torch.testing.assert_close(fused(x), _swiglu(x), rtol=0, atol=0)
    assert graphs == [[(True, False)]]  # one graph: rows symbolic, width 64 fixed
    fused(torch.randn(6, 32))
    assert graphs[1] == [(True, False)]  # a new width is a new graph, not a symbolic one


def test_a_dense_swiglu_compiles_static_shapes(graphs):
    fused = jit.jit_fuser(_swiglu)
    fused(torch.randn(8, 64))
    assert graphs == [[(False, False)]]


def test_off_the_compile_devices_the_function_runs_eagerly(graphs, monkeypatch):
    monkeypatch.setattr(jit, "COMPILE_DEVICE_TYPES", set())
    x = torch.randn(4, 16)
    torch.testing.assert_close(jit.jit_fuser(_swiglu, dynamic_rows=True)(x), _swiglu(x), rtol=0, atol=0)
    assert graphs == []


def test_the_moe_combine_is_one_graph_for_every_kept_row_count(graphs):
    """unpermute's rows are the experts' output: their count varies under EP > 1 (and with dropped slots), the
    hidden size and the [T, k] routing do not. A dropped slot points at row N, the zero row."""
    tokens, topk, hidden = 8, 2, 16
    for kept in (13, 15, 16):
        rows = torch.randn(kept, hidden)
        slots = torch.randperm(tokens * topk).clamp(max=kept).view(tokens, topk)
        probs = torch.rand(tokens, topk)
        torch.testing.assert_close(unpermute(rows, slots, probs), _unpermute(rows, slots, probs), rtol=0, atol=0)
    assert graphs == [[(True, False), (False, False), (False, False)]]
