"""The global gradient norm and clipping by it (Megatron's clip_grads.py).

A parameter replicated across TP (no `tensor_model_parallel` attribute: norms, replicated biases) has the same
gradient on every TP rank, so only TP rank 0 counts it; TP-sharded parameters are counted on every rank. The last
stage's copy of tied embeddings (`shared`) is not counted: the first stage's holds the same gradient. The squared
sums are then all-reduced over the groups that together hold one copy of every gradient element: the model-parallel
group (TP x PP), plus the DP group when the distributed optimizer holds only a shard of each bucket.

Expert parameters (MoE) are a second part with groups of its own: each rank of the expert model-parallel group
"expt_mp" (TP x EP x PP) holds different experts, so their squared sum is all-reduced over that group (plus
"expt_dp" when sharded), while the dense part's stays as above: ranks of one EP group hold the same dense
parameters. The norm is the square root of the two parts' sum (Megatron sums its chained optimizers' norms alike).
"""
from __future__ import annotations

import contextlib
from typing import Any, Sequence

import torch
import torch.distributed as dist

from probes.probe_set import NullProbeSet
from probes.protocol import ProbeSetProtocol


def param_is_not_tensor_parallel_duplicate(param: torch.nn.Parameter, tp_rank: int) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False)) or tp_rank == 0


def param_is_not_shared(param: torch.nn.Parameter) -> bool:
    """False for the last pipeline stage's copy of tied embeddings: its gradient equals the first stage's after
    finalize_model_grads, so counting both would count those elements twice."""
    return not getattr(param, "shared", False)


# The probe category of the all-reduce over each dense group kind, which names its group in a trace that records none
# (gloo's; ledger.evidence.trace_groups). The expert kinds' all-reduces run unranged: the ledger has no such group kind.
NORM_CATEGORY = {"mp": "mp-comm", "dp_cp": "dp-comm"}


def grad_norm_squared(grads_for_norm: list[torch.Tensor], groups: list[tuple[str, Any]], device: torch.device,
                      probes: ProbeSetProtocol = NullProbeSet()) -> torch.Tensor:
    """The squared L2 norm of one part's grads summed over `groups` ((kind, group) pairs): every rank of them must
    call it."""
    if grads_for_norm:
        total = torch.stack(torch._foreach_norm(grads_for_norm)).square().sum()
    else:
        total = torch.zeros((), dtype=torch.float32, device=device)
    for kind, group in groups:
        if group.size() == 1:  # over one rank the sum is the rank's own (and such a group has no communicator)
            continue
        category = NORM_CATEGORY.get(kind)
        with probes.range(f"all-reduce grad norm ({kind})", category) if category else contextlib.nullcontext():
            dist.all_reduce(total, group=group)
    return total


def get_grad_norm_fp32(parts: Sequence[tuple[list[torch.Tensor], list[tuple[str, Any]]]], device: torch.device,
                       probes: ProbeSetProtocol = NullProbeSet()) -> torch.Tensor:
    """L2 norm over every rank's grads, each part (grads, the (kind, group) pairs its squared sum is reduced over) on
    its own, as a device tensor: no host sync until someone reads it."""
    squares = [grad_norm_squared(grads, groups, device, probes) for grads, groups in parts]
    total = squares[0]
    for square in squares[1:]:
        total = total + square
    return total.sqrt()


def clip_grad_by_total_norm_fp32(grads: list[torch.Tensor], max_norm: float, total_norm: torch.Tensor,
                                 optimizer: torch.optim.Optimizer | None = None) -> None:
    """Scale by min(1, max_norm / (norm + 1e-6)) on the device, as torch's clip_grad_norm_ and Megatron do. Where the
    step's `optimizer` is torch's fused Adam(W), the scale rides in its update instead: its `grad_scale` (what AMP's
    unscaling uses; the kernel divides each gradient by it) is the inverse, so no pass reads and writes the grads
    (2 x 4 bytes a parameter: ~26 GB a step at 3.2 B parameters). Other optimizers: the grads scaled in place."""
    coeff = (max_norm / (total_norm + 1.0e-6)).clamp(max=1.0)
    if optimizer is not None and optimizer.defaults.get("fused"):
        optimizer.grad_scale = (1.0 / coeff).float()
    else:
        torch._foreach_mul_(grads, coeff)
