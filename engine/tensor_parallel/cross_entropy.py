"""Cross entropy over logits split along the vocabulary across TP, as Megatron's _VocabParallelCrossEntropy.

The full-vocabulary logits never exist on one rank. Per token:
    m    = max over all ranks of the local maxima                  (all-reduce MAX)
    z_t  = the target's logit minus m, from the rank that holds it (0 elsewhere)
    S    = sum over all ranks of sum_j exp(logit_j - m)
    loss = log S - z_t
z_t and S travel in one all-reduce (SUM). Columns past the real vocabulary (padding added for TP alignment) are set
to -inf first, so a padded entry never takes probability mass, whatever its trained weight. Backward needs only the
softmax, which is kept in place of the fp32 logits: softmax - onehot(target), scaled by the incoming grad.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from engine.tensor_parallel.mappings import TPGroup


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, tp, vocab_size):
        per_partition = vocab_parallel_logits.shape[-1]
        start = tp.rank * per_partition
        # Always a copy, even from fp32: the in-place steps below must not touch the caller's logits.
        logits = vocab_parallel_logits.to(torch.float32, copy=True)
        valid = vocab_size - start
        if valid < per_partition:
            logits[..., max(valid, 0):] = float("-inf")

        logits_max = logits.amax(dim=-1)
        if tp.size > 1:
            with tp.probes.range("tp all-reduce (ce max)", "tp-comm"):
                dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=tp.group)
        logits.sub_(logits_max.unsqueeze(-1))

        outside = (target < start) | (target >= start + per_partition)
        local_target = (target - start).masked_fill_(outside, 0)
        predicted = logits.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill_(outside, 0.0)
        exp_logits = logits.exp_()
        sums = torch.stack((predicted, exp_logits.sum(dim=-1)))
        if tp.size > 1:
            with tp.probes.range("tp all-reduce (ce sums)", "tp-comm"):
                dist.all_reduce(sums, group=tp.group)
        predicted, sum_exp = sums[0], sums[1]
        loss = sum_exp.log().sub_(predicted)

        softmax = exp_logits.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, outside, local_target)
        ctx.input_dtype = vocab_parallel_logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        softmax, outside, local_target = ctx.saved_tensors
        grad = softmax  # in place: the saved softmax is not used again
        grad.scatter_add_(-1, local_target.unsqueeze(-1), (outside.to(grad.dtype) - 1.0).unsqueeze(-1))
        grad.mul_(grad_output.unsqueeze(-1))
        return grad.to(ctx.input_dtype), None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, tp: TPGroup,
                                 vocab_size: int) -> torch.Tensor:
    """Per-token loss (fp32, target's shape) from logits [..., V_padded/tp]; vocab_size is the unpadded size."""
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, tp, vocab_size)
