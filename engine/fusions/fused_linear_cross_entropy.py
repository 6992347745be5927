"""The output layer and the vocab-parallel cross entropy fused over chunks of tokens (Megatron's
--cross-entropy-loss-fusion --cross-entropy-fusion-impl linear, megatron/core/fusions/fused_linear_cross_entropy.py).

Unfused, the output layer writes the [s, b, V/t] logits (1 GiB of bf16 for llama3's 128,256 words at 4,096 tokens)
and the loss keeps them until backward, where their gradient (as large) is written beside them. Here forward takes
the N = s b tokens C at a time (C = LINEAR_CROSS_ENTROPY_CHUNK_TOKENS): a chunk's logits x_c W^T [C, V/t], then
cross_entropy.py's fused passes give each token this rank's max m_r, sum of exp(logit - m_r) S_r and the target's
logit z_t, and the chunk's logits are dropped. Only those per-token fp32 figures outlive the chunk.

Vocab-parallel (TP), the figures are combined once for all chunks with the unfused loss's two collectives: an
all-reduce MAX of m_r gives m, then S = sum over ranks of S_r exp(m_r - m) and z_t travel in one all-reduce SUM;
loss = log S - (z_t - m). A rank whose slice is all padding has m_r = -inf, clamped to the lowest finite float so
that its S_r is 0 rather than NaN.

Backward recomputes each chunk's logits (the output layer's forward GEMM once more: the price of the memory), turns
them into dL/dlogits = (softmax - onehot(target)) g with the saved m and S (cross_entropy.py's fused pass), then the
output layer's two GEMMs on the chunk: dx_c = dlogits W and dW += dlogits^T x_c, the latter into DDP's fp32
main_grad where gradient accumulation fusion applies (tensor_parallel/layers.py), else into one gradient tensor of
the weight's dtype. Saved for backward: the input (its sequence shard under SP, gathered again in backward, as the
parallel linears do), the targets (int64 and a bool mask) and m and S (fp32), per token.

Without sequence parallelism the input enters the TP region as the output layer's does (its gradient all-reduced);
with it the input is all-gathered along the sequence and its gradient reduce-scattered.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from common.config import LINEAR_CROSS_ENTROPY_CHUNK_TOKENS
from engine.tensor_parallel.cross_entropy import _local_max, _softmax_minus_onehot, _sum_exp_and_target_logit
from engine.tensor_parallel.layers import (
    ColumnParallelLinear,
    addmm_into,
    fused_weight_grad_placeholder,
    fuses_weight_grad,
)
from engine.tensor_parallel.mappings import (
    TPGroup,
    _all_gather,
    _reduce_scatter_dim0,
    copy_to_tensor_model_parallel_region,
)

CHUNK_TOKENS = LINEAR_CROSS_ENTROPY_CHUNK_TOKENS


def _chunks(n: int, size: int) -> list[slice]:
    return [slice(lo, min(lo + size, n)) for lo in range(0, n, size)]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, tp, vocab_size, sequence_parallel, chunk_tokens):
        total = _all_gather(hidden, tp, 0, "sp all-gather") if sequence_parallel else hidden
        x = total.reshape(-1, total.shape[-1])
        per_partition = weight.shape[0]
        start = tp.rank * per_partition
        valid = vocab_size - start  # this rank's real (unpadded) columns, if fewer than per_partition
        target = target.reshape(-1)
        outside = (target < start) | (target >= start + per_partition)
        local_target = (target - start).masked_fill_(outside, 0)
        logits_max, sum_exp, target_logit = (x.new_empty(x.shape[0], dtype=torch.float32) for _ in range(3))
        for rows in _chunks(x.shape[0], chunk_tokens):
            logits = F.linear(x[rows], weight)
            logits_max[rows] = _local_max(logits, valid).clamp_(min=torch.finfo(torch.float32).min)
            sum_exp[rows], target_logit[rows] = _sum_exp_and_target_logit(logits, logits_max[rows],
                                                                          local_target[rows], outside[rows], valid)
            del logits  # one chunk's logits at a time
        if tp.size > 1:
            local_max = logits_max.clone()
            with tp.probes.range("tp all-reduce (ce max)", "tp-comm"):
                dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=tp.group)
            sums = torch.stack((target_logit, sum_exp.mul_((local_max - logits_max).exp_())))
            with tp.probes.range("tp all-reduce (ce sums)", "tp-comm"):
                dist.all_reduce(sums, group=tp.group)
            target_logit, sum_exp = sums[0], sums[1]
        ctx.save_for_backward(hidden, weight, local_target, outside, logits_max, sum_exp)
        ctx.tp, ctx.sequence_parallel, ctx.valid, ctx.chunk_tokens = tp, sequence_parallel, valid, chunk_tokens
        return (sum_exp.log() - (target_logit - logits_max)).view(total.shape[:-1])

    @staticmethod
    def backward(ctx, grad_output):
        hidden, weight, local_target, outside, logits_max, sum_exp = ctx.saved_tensors
        tp = ctx.tp
        total = _all_gather(hidden, tp, 0, "sp all-gather (linear bwd)") if ctx.sequence_parallel else hidden
        x = total.reshape(-1, total.shape[-1])
        g = grad_output.reshape(-1)
        grad_x = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        fused = ctx.needs_input_grad[1] and fuses_weight_grad(weight)
        grad_weight = torch.zeros_like(weight) if ctx.needs_input_grad[1] and not fused else None
        for rows in _chunks(x.shape[0], ctx.chunk_tokens):
            logits = F.linear(x[rows], weight)  # recomputed
            dlogits = _softmax_minus_onehot(logits, logits_max[rows], sum_exp[rows], local_target[rows],
                                            outside[rows], g[rows], ctx.valid)
            del logits
            if grad_x is not None:
                torch.matmul(dlogits, weight, out=grad_x[rows])
            if ctx.needs_input_grad[1]:
                addmm_into(weight.main_grad if fused else grad_weight, dlogits.t(), x[rows])
            del dlogits
        if fused:
            grad_weight = fused_weight_grad_placeholder(weight)
        grad_input = None
        if grad_x is not None:
            grad_input = grad_x.view_as(total)
            if ctx.sequence_parallel:
                grad_input = _reduce_scatter_dim0(grad_input, tp, "sp reduce-scatter (linear bwd)")
        return grad_input, grad_weight, None, None, None, None, None


class LinearCrossEntropyModule(ColumnParallelLinear):
    """The output layer of a model whose loss is fused with it (Megatron's LinearCrossEntropyModule): a
    ColumnParallelLinear (the same weight, name and shard) whose forward, given labels, returns the per-token loss
    [b, s] through linear_cross_entropy instead of the logits. Called as a module, so that what hooks the output
    layer (DDP's wait for its parameters' all-gather under --overlap-param-gather) sees it run. vocab_size is the
    unpadded vocabulary (the padding columns take no probability)."""

    def __init__(self, input_size: int, output_size: int, *, vocab_size: int, **kwargs: Any):
        super().__init__(input_size, output_size, **kwargs)
        self.vocab_size = vocab_size

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None,
                labels: torch.Tensor | None = None) -> torch.Tensor:
        if labels is None:
            return super().forward(x, weight)
        weight = self.weight if weight is None else weight
        return linear_cross_entropy(x, weight, labels.t(), self.tp, self.vocab_size,
                                    sequence_parallel=self.sequence_parallel).t().contiguous()


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, target: torch.Tensor, tp: TPGroup,
                         vocab_size: int, *, sequence_parallel: bool = False) -> torch.Tensor:
    """Per-token loss [s, b] (fp32) of the output layer's weight [V_padded/t, h] on hidden [s, b, h] ([s/t, b, h]
    under sequence parallelism) against target [s, b]; vocab_size is the unpadded size. The same numbers as
    vocab_parallel_cross_entropy(ColumnParallelLinear(hidden), target) without the logits held whole. The chunk
    size is read at the call (CHUNK_TOKENS), so that a test can make chunks of a tiny model's few tokens."""
    if not sequence_parallel:
        hidden = copy_to_tensor_model_parallel_region(hidden, tp)
    return _LinearCrossEntropy.apply(hidden, weight, target, tp, vocab_size, sequence_parallel and tp.size > 1,
                                     CHUNK_TOKENS)
