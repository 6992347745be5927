"""The top-k router (Megatron's TopKRouter with its defaults: softmax scores, top-k over the logits then a softmax
over the k chosen, moe_router_pre_softmax off), its load-balancing loss and the expert capacity.

- Gate: a linear h -> E without bias, one dense parameter replicated over EP (every rank routes its own tokens to
  every expert), reduced over DP like any dense weight. The softmaxes run in fp32.
- Load balancing (Switch Transformer, Megatron's switch_load_balancing_loss_func with top-k): over this rank's T
  tokens of the micro-batch, f_e = (assignments to e) / (T k) and P_e = the mean over tokens of softmax(logits)_e
  over all E experts; loss = coeff x E x sum_e f_e P_e. It is 1 x coeff when routing is uniform. Only P carries a
  gradient (f counts). The loss never enters the reported lm loss: it is attached to the routing probabilities
  (Megatron's MoEAuxLossAutoScaler), whose backward hands the loss a gradient of 1 / num_microbatches, the factor
  by which the schedule divides each micro-batch's lm loss, so the update is that of (lm + aux) averaged over
  micro-batches (DDP averages over DP alike).
- Capacity (--moe-expert-capacity-factor c): each expert takes at most ceil(T k / E x c) of this rank's
  assignments in the micro-batch; over that, Megatron's drop policy "probs" keeps the assignments with the highest
  routing probability (ties: the earlier token) and drops the rest. A dropped assignment contributes nothing to
  its token's output; the kept probabilities are not renormalised (as Megatron). The load-balancing loss counts
  assignments before dropping.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from common.config import ModelConfig
from engine.tensor_parallel.layers import set_tensor_model_parallel_attributes
from engine.tensor_parallel.random import MasterWeightInit, sharded_master_weight


@dataclass
class Routing:
    """One micro-batch's routing of this rank's T tokens over E experts, k per token."""
    experts: torch.Tensor  # [T, k] int64, the chosen experts, highest logit first
    probs: torch.Tensor  # [T, k] fp32, softmax over the k chosen logits (the load-balancing loss attached)
    kept: torch.Tensor  # [T, k] bool, False where the expert's capacity dropped the assignment
    tokens_per_expert: torch.Tensor  # [E] int64, assignments before dropping
    dropped_per_expert: torch.Tensor  # [E] int64, assignments over capacity
    aux_loss: torch.Tensor  # fp32 scalar, detached, coefficient applied (0 without a coefficient)


def count_per_expert(experts: torch.Tensor, num_experts: int, where: torch.Tensor | None = None) -> torch.Tensor:
    """[num_experts] int64: how many entries of `experts` (where `where` holds, if given) name each expert, on the
    device and without a host read (CUDA's bincount reads the largest index back to size its output)."""
    ones = where.reshape(-1).long() if where is not None else torch.ones_like(experts.reshape(-1))
    return torch.zeros(num_experts, dtype=torch.long, device=experts.device).scatter_add_(0, experts.reshape(-1), ones)


def topk_softmax(logits: torch.Tensor, topk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(experts [T, k], probs [T, k]): the k largest logits per token, their softmax in fp32."""
    chosen, experts = torch.topk(logits, topk, dim=-1)
    return experts, torch.softmax(chosen.float(), dim=-1)


def load_balancing_loss(logits: torch.Tensor, tokens_per_expert: torch.Tensor, topk: int,
                        coeff: float) -> torch.Tensor:
    """coeff x E x sum_e f_e P_e over the T tokens of logits [T, E] (module docstring)."""
    num_tokens, num_experts = logits.shape
    mean_probs = torch.softmax(logits.float(), dim=-1).mean(dim=0)  # P_e
    fraction = tokens_per_expert.float() / (num_tokens * topk)  # f_e
    return coeff * num_experts * torch.sum(fraction * mean_probs)


def expert_capacity(num_tokens: int, topk: int, num_experts: int, capacity_factor: float) -> int:
    """Megatron's get_capacity for the top-k assignments of num_tokens tokens."""
    return math.ceil(num_tokens * topk / num_experts * capacity_factor)


def keep_within_capacity(experts: torch.Tensor, probs: torch.Tensor, capacity: int,
                         num_experts: int) -> torch.Tensor:
    """[T, k] bool: each expert keeps its `capacity` assignments of highest probability (ties: earlier token)."""
    flat_experts, flat_probs = experts.reshape(-1), probs.detach().reshape(-1)
    by_prob = torch.argsort(flat_probs, descending=True, stable=True)  # ties keep token order
    order = by_prob[torch.argsort(flat_experts[by_prob], stable=True)]  # expert-major, then by probability
    counts = count_per_expert(flat_experts, num_experts)
    starts = torch.cumsum(counts, 0) - counts
    rank_in_expert = torch.empty_like(order)
    rank_in_expert[order] = torch.arange(order.numel(), device=order.device) - starts[flat_experts[order]]
    return (rank_in_expert < capacity).view_as(experts)


class _AttachAuxLoss(torch.autograd.Function):
    """Identity on probs; in backward also gives aux_loss the gradient `scale` (Megatron's MoEAuxLossAutoScaler)."""

    @staticmethod
    def forward(ctx, probs, aux_loss, scale):
        ctx.save_for_backward(aux_loss)
        ctx.scale = scale
        return probs

    @staticmethod
    def backward(ctx, grad):
        (aux_loss,) = ctx.saved_tensors
        return grad, torch.full_like(aux_loss, ctx.scale), None


class TopKRouter(torch.nn.Module):
    def __init__(self, config: ModelConfig, prefix: str, *, num_microbatches: int, params_dtype: torch.dtype,
                 device: torch.device | str, seed: int):
        """prefix names the init seed (`decoder.layers.{n}.mlp.router`); num_microbatches is the schedule's
        divisor of each micro-batch's loss, which the load-balancing loss's gradient takes too."""
        super().__init__()
        self.num_experts, self.topk = config.num_experts, config.moe_router_topk
        self.aux_loss_coeff, self.capacity_factor = config.moe_aux_loss_coeff, config.moe_expert_capacity_factor
        self.aux_loss_scale = 1.0 / num_microbatches
        init = MasterWeightInit(config.init_method_std, seed, f"{prefix}.weight")
        self.weight = torch.nn.Parameter(sharded_master_weight(
            init, (config.num_experts, config.hidden_size), partition_dim=None, stride=1, rank=0, size=1,
            dtype=params_dtype, device=torch.device(device)))
        set_tensor_model_parallel_attributes(self.weight, False, None, 1)

    def forward(self, hidden_states: torch.Tensor) -> Routing:
        """hidden_states [T, h] -> this micro-batch's Routing."""
        return self.route(F.linear(hidden_states, self.weight))

    def route(self, logits: torch.Tensor) -> Routing:
        """The gate's logits [T, E] -> the Routing (apart from the GEMM so that the compute sweep times it alone)."""
        experts, probs = topk_softmax(logits, self.topk)
        tokens_per_expert = count_per_expert(experts, self.num_experts)
        kept = torch.ones_like(experts, dtype=torch.bool)
        dropped = torch.zeros_like(tokens_per_expert)
        if self.capacity_factor is not None:
            capacity = expert_capacity(logits.shape[0], self.topk, self.num_experts, self.capacity_factor)
            kept = keep_within_capacity(experts, probs, capacity, self.num_experts)
            dropped = count_per_expert(experts, self.num_experts, where=~kept)
        aux_loss = probs.new_zeros(())
        if self.aux_loss_coeff > 0 and torch.is_grad_enabled():
            aux_loss = load_balancing_loss(logits, tokens_per_expert, self.topk, self.aux_loss_coeff)
            probs = _AttachAuxLoss.apply(probs, aux_loss, self.aux_loss_scale)
        return Routing(experts=experts, probs=probs, kept=kept, tokens_per_expert=tokens_per_expert,
                       dropped_per_expert=dropped, aux_loss=aux_loss.detach())
