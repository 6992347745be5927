"""Cross entropy over logits split along the vocabulary across TP, as Megatron's _VocabParallelCrossEntropy.

The full-vocabulary logits never exist on one rank. Per token:
    m    = max over all ranks of the local maxima                  (all-reduce MAX)
    z_t  = the target's logit, from the rank that holds it (0 elsewhere)
    S    = sum over all ranks of sum_j exp(logit_j - m)
    loss = log S - (z_t - m)
z_t and S travel in one all-reduce (SUM). Columns past the real vocabulary (padding added for TP alignment) count
as -inf, so a padded entry never takes probability mass, whatever its trained weight.

Forward keeps the 16-bit logits and m and S (two fp32 numbers per token) for backward, which recomputes
dL/dlogits = (softmax - onehot(target)) x grad from them, instead of keeping an fp32 softmax (Megatron's way). The
three passes over the logits (max; S and z_t; the gradient) are jit_fuser functions: compiled on GPU, each is one
kernel that reads the 16-bit logits once and writes no fp32 [s, b, V] tensor. With llama3's 128k vocabulary and
4096 tokens that is ~4 GB of memory traffic per micro-batch instead of ~27 GB, and the 2 GB fp32 softmax is never
held. Eager (CPU, or TRAIN_LEDGER_COMPILE=0) they compute the same numbers through an fp32 copy per pass, which
costs more than keeping the softmax would: that mode is for tests and for measuring what compilation buys.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from engine.jit import jit_fuser
from engine.tensor_parallel.mappings import TPGroup


def _fp32_logits(logits: torch.Tensor, valid: int) -> torch.Tensor:
    """An fp32 copy of the local logits (a copy even from fp32: callers work in place), columns from `valid` on
    (vocabulary padding) at -inf."""
    x = logits.to(torch.float32, copy=True)
    if valid < x.shape[-1]:
        x[..., max(valid, 0):] = float("-inf")
    return x


@jit_fuser
def _local_max(logits: torch.Tensor, valid: int) -> torch.Tensor:
    return _fp32_logits(logits, valid).amax(dim=-1)


@jit_fuser
def _sum_exp_and_target_logit(logits: torch.Tensor, logits_max: torch.Tensor, local_target: torch.Tensor,
                              outside: torch.Tensor, valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's share of S, and z_t where this rank holds the target (0 where it does not)."""
    x = _fp32_logits(logits, valid)
    target_logit = x.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill_(outside, 0.0)
    return x.sub_(logits_max.unsqueeze(-1)).exp_().sum(dim=-1), target_logit


@jit_fuser
def _softmax_minus_onehot(logits: torch.Tensor, logits_max: torch.Tensor, sum_exp: torch.Tensor,
                          local_target: torch.Tensor, outside: torch.Tensor, grad_output: torch.Tensor,
                          valid: int) -> torch.Tensor:
    """(softmax - onehot(target)) x grad_output, in the logits' dtype.

    The one-hot is a comparison with the column index rather than a scatter, which would make the compiled kernel
    write the fp32 softmax out first; add_ takes the bool mask as it is, so eager builds no fp32 one-hot either.
    """
    grad = _fp32_logits(logits, valid).sub_(logits_max.unsqueeze(-1)).exp_().div_(sum_exp.unsqueeze(-1))
    columns = torch.arange(grad.shape[-1], device=grad.device)
    grad.add_(columns == local_target.masked_fill(outside, -1).unsqueeze(-1), alpha=-1.0)
    return grad.mul_(grad_output.unsqueeze(-1)).to(logits.dtype)


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, vocab_parallel_logits, target, tp, vocab_size):
        logits = vocab_parallel_logits
        per_partition = logits.shape[-1]
        start = tp.rank * per_partition
        valid = vocab_size - start  # this rank's real (unpadded) columns, if fewer than per_partition

        logits_max = _local_max(logits, valid)
        if tp.size > 1:
            with tp.probes.range("tp all-reduce (ce max)", "tp-comm"):
                dist.all_reduce(logits_max, op=dist.ReduceOp.MAX, group=tp.group)

        outside = (target < start) | (target >= start + per_partition)
        local_target = (target - start).masked_fill_(outside, 0)
        sum_exp, target_logit = _sum_exp_and_target_logit(logits, logits_max, local_target, outside, valid)
        if tp.size > 1:
            sums = torch.stack((target_logit, sum_exp))
            with tp.probes.range("tp all-reduce (ce sums)", "tp-comm"):
                dist.all_reduce(sums, group=tp.group)
            target_logit, sum_exp = sums[0], sums[1]

        ctx.save_for_backward(logits, logits_max, sum_exp, local_target, outside)
        ctx.valid = valid
        return sum_exp.log() - (target_logit - logits_max)

    @staticmethod
    def backward(ctx, grad_output):
        logits, logits_max, sum_exp, local_target, outside = ctx.saved_tensors
        grad = _softmax_minus_onehot(logits, logits_max, sum_exp, local_target, outside, grad_output, ctx.valid)
        return grad, None, None, None


def vocab_parallel_cross_entropy(vocab_parallel_logits: torch.Tensor, target: torch.Tensor, tp: TPGroup,
                                 vocab_size: int) -> torch.Tensor:
    """Per-token loss (fp32, target's shape) from logits [..., V_padded/tp]; vocab_size is the unpadded size."""
    return _VocabParallelCrossEntropy.apply(vocab_parallel_logits, target, tp, vocab_size)
