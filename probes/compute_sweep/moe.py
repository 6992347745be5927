"""An MoE layer's kernels beside its GEMMs, through the engine's own functions (EngineKernels.moe: its router after
the GEMM, its dispatcher at EP 1) on uniform routing: router.topk (top-k, softmaxes, counts, the load-balancing loss
and capacity drops where configured), moe.permute (the rows sorted by expert and split per expert) and moe.unpermute
(the experts' outputs concatenated, as SequentialMLP does, and combined per token), forward and backward. The
experts' MLPs are gemm.py's and elementwise.py's, except under --moe-grouped-gemm: each linear's grouped GEMM
(experts.linear_fc1 / .linear_fc2 .fprop / .dgrad) through the engine's own (EngineKernels.moe.grouped_linear,
on weights one stride apart in one tensor as DDP lays GroupedMLP's out, so that it reads them in place; dgrad
through its autograd backward), the rows split per expert as uniform routing splits them (each expert's wgrad is a
dense linear's: gemm.py's). The all-to-alls are the bandwidth sweep's."""
from __future__ import annotations

from typing import Callable

import torch

from common.ops import ExpertShapes
from common.ops.moe import DELAYED_CAT
from probes.compute_sweep.calls import Backward, Bench, Builder, Call, Op, Tensors


def uniform_routing(x: ExpertShapes, t: Tensors, grad: bool) -> tuple[torch.Tensor, ...]:
    """experts [T, k] spreading the T k assignments evenly (assignment i to expert i mod E: k distinct experts a
    token), probs [T, k] fp32, kept [T, k] (an expert keeps its first `capacity`)."""
    slots = torch.arange(x.tokens * x.topk, device=t.device)
    experts = (slots % x.experts).view(x.tokens, x.topk)
    kept = slots // x.experts < (x.capacity if x.capacity is not None else x.tokens * x.topk)
    return experts, t.randn(x.tokens, x.topk, dtype=torch.float32, grad=grad), kept.view(x.tokens, x.topk)


def builders(b: Bench) -> dict[str, Builder]:
    t, x, kernels = b.tensors, b.shapes.moe, b.kernels.moe

    def route(backward: bool) -> Builder:
        def build(d: dict[str, int]) -> Op:
            logits = t.randn(d["tokens"], d["experts"], grad=backward)
            if not backward:
                return Call(lambda: kernels.route(logits))
            return Backward(lambda: kernels.route(logits)[1], (logits,),
                            (t.randn(d["tokens"], d["topk"], dtype=torch.float32),))
        return build

    def permuted(h: int, backward: bool) -> tuple[Callable[[], tuple[torch.Tensor, ...]], torch.Tensor]:
        """The dispatch as the experts see it: the permuted rows split per expert (their backward: a cat)."""
        tokens = t.randn(x.tokens, h, grad=backward)
        experts, probs, kept = uniform_routing(x, t, grad=False)

        def forward() -> tuple[torch.Tensor, ...]:
            rows, per_expert, _ = kernels.permute(tokens, experts, probs, kept)
            return rows.split(per_expert)
        return forward, tokens

    def permute(backward: bool) -> Builder:
        def build(d: dict[str, int]) -> Op:
            forward, tokens = permuted(d["hidden"], backward)
            if not backward:
                return Call(forward)
            return Backward(forward, (tokens,), tuple(t.randn(*c.shape) for c in forward()))
        return build

    def unpermute(backward: bool) -> Builder:
        def build(d: dict[str, int]) -> Op:
            h = d["hidden"]
            tokens = t.randn(x.tokens, h)
            experts, probs, kept = uniform_routing(x, t, grad=backward)
            _, per_expert, plan = kernels.permute(tokens, experts, probs, kept)
            outputs = tuple(t.randn(n, h, grad=backward) for n in per_expert)
            if not backward:
                return Call(lambda: kernels.unpermute(torch.cat(outputs), plan))
            return Backward(lambda: kernels.unpermute(torch.cat(outputs), plan), (*outputs, probs),
                            (t.randn(x.tokens, h),))
        return build

    def concatenate(d: dict[str, int]) -> Op:
        """--moe-delay-expert-wgrad's flush: a weight's held operands, `pieces` micro-batches' rows, made one."""
        pieces = [t.randn(d["rows"] // d["pieces"], d["width"]) for _ in range(d["pieces"])]
        return Call(lambda: torch.cat(pieces))

    out: dict[str, Builder] = {DELAYED_CAT: concatenate}
    for p, backward in (("fwd", False), ("bwd", True)):
        out |= {f"router.topk.{p}": route(backward), f"moe.permute.{p}": permute(backward),
                f"moe.unpermute.{p}": unpermute(backward)}
    return out | (grouped_builders(b) if x.grouped else {})


def grouped_builders(b: Bench) -> dict[str, Builder]:
    """The grouped expert GEMMs at the catalogue's m, n, k (common/ops/linear.py grouped_linear): fprop [m, k] rows
    through `experts` weights [n, k]; dgrad and wgrad as the backward of that fprop (rows m, out n, in k for dgrad;
    out m, in n, rows k for wgrad)."""
    t, x, kernels = b.tensors, b.shapes.moe, b.kernels.moe
    if kernels.grouped_linear is None:
        raise ValueError("a sweep of grouped expert GEMMs needs the engine's (MoEKernels.grouped_linear)")
    counts = torch.tensor(x.rows, device=t.device)

    def call(rows: int, out: int, inp: int, dgrad: bool) -> Op:
        a = t.randn(rows, inp, grad=dgrad)
        weights = list(t.randn(x.local_experts, out, inp).unbind(0))
        if not dgrad:
            return Call(lambda: kernels.grouped_linear(a, weights, counts))
        return Backward(lambda: kernels.grouped_linear(a, weights, counts), (a,), (t.randn(rows, out),))

    passes: dict[str, Builder] = {
        "fprop": lambda d: call(d["m"], d["n"], d["k"], False),
        "dgrad": lambda d: call(d["m"], d["k"], d["n"], True)}
    return {f"experts.{linear}.{p}": build for linear in ("linear_fc1", "linear_fc2") for p, build in passes.items()}
