"""This rank's experts: E / EP SwiGLU MLPs of width moe_ffn_hidden_size on the tokens grouped by expert, run one after
another (Megatron's SequentialMLP) or, under --moe-grouped-gemm, each linear of all of them as one grouped GEMM
(GroupedMLP).

EP rank r holds global experts [r E/ep, (r + 1) E/ep). Each expert is a child module named by its global index, so
its parameters are `decoder.layers.{n}.mlp.experts.{e}.linear_fc1.weight` (and linear_fc2) at any EP size: that
name seeds its initial value (MasterWeightInit), so every EP split starts from the single-process model, and
checkpoints and parity tests match experts by it. Every expert parameter carries `allreduce = False` (Megatron's
marker): its gradient is reduced over the expert-data-parallel group, not the dense DP group.

Under --moe-pad-expert-rows N, SequentialMLP runs each expert on its rows padded with zero rows to a multiple of N
and keeps the first rows of the output: the zero rows' outputs go nowhere, so their gradients are zero and add
nothing to the weights' (the maths is unchanged), while cuBLAS sees a handful of row counts instead of a new one at
almost every call (its first call at a shape chooses a kernel on the host: milliseconds at some small counts).

Under --moe-delay-expert-wgrad every expert weight's gradient waits for the step's end (tensor_parallel/layers.py
delay_weight_grad): each micro-batch's backward holds its input rows and output gradient, and finalize_model_grads
computes dL/dW once over all of them, at ~m T k / E rows instead of m GEMMs of ~T k / E rows each. With both flags
an expert whose rows need no padding still goes through the padded path: its rows a view of the layer's dispatched
tensor and its output gradient a view of combine's, the held operands would keep both whole tensors alive to the
step's end where the padded experts hold their own copies (64 MiB each a layer and micro-batch on mixtral-8x7b-2l,
which an H200 snapshot showed: BENCHMARKS.md, 2026-12-04).
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import torch
import torch.nn.functional as F

from common.config import ModelConfig
from common.ops.sizes import padded_rows
from engine.tensor_parallel.layers import delay_weight_grad
from engine.tensor_parallel.mappings import TPGroup
from engine.transformer.mlp import MLP, swiglu, swiglu_any_rows
from engine.transformer.moe.grouped_gemm_util import ExpertGroups, grouped_linear
from engine.transformer.moe.router import expert_capacity
from engine.transformer.moe.routing_record import counted_forward


def local_expert_indices(num_experts: int, ep_size: int, ep_rank: int) -> range:
    per_rank = num_experts // ep_size
    return range(ep_rank * per_rank, (ep_rank + 1) * per_rank)


class SequentialMLP(torch.nn.Module):
    def __init__(self, config: ModelConfig, prefix: str, *, ep_size: int, ep_rank: int, tp: TPGroup,
                 params_dtype: torch.dtype, device: torch.device | str, seed: int):
        """prefix is the MoE layer's (`decoder.layers.{n}.mlp`)."""
        super().__init__()
        self.global_indices = local_expert_indices(config.num_experts, ep_size, ep_rank)
        expert_config = dataclasses.replace(config, ffn_hidden_size=config.expert_ffn_hidden_size)
        for e in self.registration_order():
            self.add_module(str(e), MLP(expert_config, f"{prefix}.experts.{e}", tp=tp, sequence_parallel=False,
                                        params_dtype=params_dtype, device=device, seed=seed, any_rows=True))
        for param in self.parameters():
            param.allreduce = False
            if config.moe_delay_expert_wgrad:
                delay_weight_grad(param)
        self.pad_rows = config.moe_pad_expert_rows
        self.copies_unpadded = bool(config.moe_pad_expert_rows and config.moe_delay_expert_wgrad)
        self.rows_run: list[list[int]] = []  # each counted forward's rows per local expert, as its GEMMs ran them

    def registration_order(self) -> Sequence[int]:
        """The order the experts are registered in, hence their parameters' order (by global index)."""
        return self.global_indices

    def local_experts(self) -> list[MLP]:
        """This rank's experts by global index."""
        return [self.get_submodule(str(e)) for e in self.global_indices]

    def forward(self, tokens: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        """tokens [N, h] grouped by local expert, tokens_per_expert[i] rows for the i-th -> outputs [N, h]."""
        chunks = tokens.split(tokens_per_expert)
        if counted_forward():
            self.rows_run.append([padded_rows(n, self.pad_rows) for n in tokens_per_expert])
        return torch.cat([self._expert(expert, chunk) for expert, chunk in zip(self.local_experts(), chunks)])

    def take_rows_run(self) -> list[list[int]]:
        """The rows each local expert's GEMMs ran in every counted forward since the last take (routing_record.py says
        which forwards count): the shapes cuBLAS met, each new one a kernel choice on the host."""
        taken, self.rows_run = self.rows_run, []
        return taken

    def _expert(self, expert: MLP, rows: torch.Tensor) -> torch.Tensor:
        """One expert on its rows, padded under --moe-pad-expert-rows, its own copies of them whatever the padding
        where its operands are held for the flush (module docstring)."""
        pad = padded_rows(rows.shape[0], self.pad_rows) - rows.shape[0]
        if pad == 0 and not self.copies_unpadded:
            return expert(rows)
        return expert(F.pad(rows, (0, 0, 0, pad)))[:rows.shape[0]]


class GroupedMLP(SequentialMLP):
    """SequentialMLP's experts (the same parameters, names and initial values, so checkpoints and parity tests see
    no difference), computed as two grouped GEMMs and one SwiGLU over all the rows (grouped_gemm_util.py) instead of
    a GEMM pair per expert, on the row counts as a device tensor: at EP 1 the forward never waits for them
    (SequentialMLP must, to split the rows); the backward's per-expert weight gradients read the forward's copy.

    The experts are registered last-first: DDP lays parameters out in reverse order, so each linear's weights then
    lie one stride apart, first expert first, and the grouped GEMMs read them as one [E, n, k] view of the buffer
    (no copy: stacked_weights). Rows past the counts (assignments dropped over capacity, at EP 1) come out as zeros.
    """
    # Its forward reads the experts' weights without calling their modules: DDP's forward pre-hook, which waits for
    # parameters' all-gather under --overlap-param-gather, must wait for them here (distributed_data_parallel.py).
    uses_submodule_weights = True

    def __init__(self, config: ModelConfig, prefix: str, *, ep_size: int, ep_rank: int, tp: TPGroup,
                 params_dtype: torch.dtype, device: torch.device | str, seed: int):
        super().__init__(config, prefix, ep_size=ep_size, ep_rank=ep_rank, tp=tp, params_dtype=params_dtype,
                         device=device, seed=seed)
        self.topk, self.capacity_factor = config.moe_router_topk, config.moe_expert_capacity_factor
        self.num_experts = config.num_experts
        self.activation = swiglu if ep_size == 1 else swiglu_any_rows  # at EP 1 the row count is always T k
        for param in self.parameters():  # DDP's buckets keep the layer's experts together (one stride apart)
            param.bucket_group = prefix

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor | list[int]) -> torch.Tensor:
        """tokens [N, h] grouped by local expert; tokens_per_expert [E/EP]: a device tensor (EP 1: the dispatcher
        keeps the counts there, N = T k rows, the dropped ones last) or the host's list (EP > 1, all N rows kept)."""
        groups = self.groups(tokens.shape[0], tokens_per_expert)
        experts = self.local_experts()
        hidden = grouped_linear(tokens, [e.linear_fc1.weight for e in experts], groups)
        return grouped_linear(self.activation(hidden), [e.linear_fc2.weight for e in experts], groups)

    def registration_order(self) -> Sequence[int]:
        return self.global_indices[::-1]

    def groups(self, rows: int, tokens_per_expert: torch.Tensor | list[int]) -> ExpertGroups:
        """Where each of the `rows` rows goes (grouped_gemm_util.ExpertGroups), on the device."""
        on_host = isinstance(tokens_per_expert, list)
        counts = torch.as_tensor(tokens_per_expert, dtype=torch.long, device=next(self.parameters()).device)
        return ExpertGroups.of(counts, rows, self._max_rows(rows, tokens_per_expert),
                               may_drop=not on_host and self.capacity_factor is not None,
                               host_counts=tokens_per_expert if on_host else None)

    def _max_rows(self, rows: int, tokens_per_expert: torch.Tensor | list[int]) -> int:
        """A bound on every expert's rows that the host knows without reading the device (the fallback's padded
        size): the counts themselves when they are a host list; at EP 1 the tokens T = N / k (a token picks an
        expert at most once), or the capacity when lower."""
        if isinstance(tokens_per_expert, list):
            return max(tokens_per_expert, default=0)
        tokens = rows // self.topk
        if self.capacity_factor is None:
            return tokens
        return min(tokens, expert_capacity(tokens, self.topk, self.num_experts, self.capacity_factor))
