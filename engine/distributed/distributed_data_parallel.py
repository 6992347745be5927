"""DistributedDataParallel: Megatron's, not torch's (docs/engine.md, "Data parallel").

It moves every trainable parameter into contiguous buffers, accumulates gradients into `param.main_grad` from a
per-parameter hook, and reduces them bucket by bucket over the data-parallel group (DP x CP). The schedule reaches
it only through no_sync / start_grad_sync / finish_grad_sync / start_param_sync, so communication happens once per
step per bucket group, after the last micro-batch.

Expert parameters (`param.allreduce = False`, Megatron's marker) go into buffers of their own after the dense ones
(Megatron's expert_parallel_buffers): padded and sharded over the expert-data-parallel group "expt_dp", reduced over
it with the gradients scaled by 1/(dp x cp) (param_and_grad_buffer._ParamAndGradBucketGroup says why). Bucket
groups are numbered dense first, then expert, so the inventory's order of buckets is their numbering; the all-gather
chain of the forward pre-hooks runs within each kind. A model without expert parameters builds exactly what it
built before.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext
from typing import Any, Iterator

import torch

from engine.distributed.distributed_data_parallel_config import (
    DistributedDataParallelConfig,
    default_bucket_size,
)
from engine.distributed.param_and_grad_buffer import (
    _ParamAndGradBucketGroup,
    _ParamAndGradBuffer,
)
from probes.probe_set import NullProbeSet
from probes.protocol import ProbeSetProtocol


def params_used_by_forward(module: torch.nn.Module) -> Iterator[torch.nn.Parameter]:
    """The parameters a module's forward reads, which its forward pre-hook waits for: its own, and its submodules'
    too where it computes with their weights without calling them (`uses_submodule_weights`: GroupedMLP stacks its
    experts' linear weights)."""
    return module.parameters(recurse=getattr(module, "uses_submodule_weights", False))


class DistributedDataParallel(torch.nn.Module):
    def __init__(self, config: DistributedDataParallelConfig, module: torch.nn.Module, parallel_state: Any,
                 probes: ProbeSetProtocol | None = None, disable_bucketing: bool = False):
        """disable_bucketing: one bucket per buffer, as Megatron does for model chunks after the first."""
        super().__init__()
        self.ddp_config = config
        self.module = module
        self.parallel_state = parallel_state
        self.probes = probes if probes is not None else NullProbeSet()
        self.data_parallel_group = parallel_state.groups["dp_cp"]
        dp_size = self.data_parallel_group.size()
        # As Megatron: without overlap there is nothing to overlap a bucket with, so one bucket (one collective);
        # later pipeline stages' DP communication is off the critical path, so they get one bucket too.
        if disable_bucketing or not config.overlap_grad_reduce or parallel_state.pp_rank > 0:
            self.bucket_size = None
        else:
            self.bucket_size = config.bucket_size if config.bucket_size is not None else default_bucket_size(dp_size)

        self.param_to_name = {p: n for n, p in module.named_parameters() if p.requires_grad}
        dense = [p for p in self.param_to_name if getattr(p, "allreduce", True)]
        expert = [p for p in self.param_to_name if not getattr(p, "allreduce", True)]
        self.buffers = self._make_buffers(dense, self.data_parallel_group, expert=False)
        dense_groups = self._make_bucket_groups(self.buffers, 0, None)
        expert_buffers, expert_groups = [], []
        if expert:
            if "expt_dp" not in parallel_state.groups:
                raise ValueError("expert parameters (allreduce False) need the expert groups: build the "
                                 "ParallelState with moe=True")
            expert_buffers = self._make_buffers(expert, parallel_state.groups["expt_dp"], expert=True)
            expert_groups = self._make_bucket_groups(expert_buffers, len(dense_groups), 1.0 / dp_size)
        # Dense buffers first, then expert ones: every user of `buffers` (optimizer, checkpoints) takes both.
        self.buffers += expert_buffers
        self.bucket_groups = dense_groups + expert_groups
        # The heads of the forward's all-gather chains: the distributed optimizer issues these first.
        self.param_gather_chain_heads = [groups[-1] for groups in (dense_groups, expert_groups) if groups]
        self.param_to_bucket_group = {p: g for g in self.bucket_groups for p in g.params}

        for param in self.param_to_name:
            # The parallel linears may add dL/dW into main_grad inside their GEMM (gradient-accumulation fusion);
            # they set this flag when they did, so the hook must not add again.
            param.grad_added_to_main_grad = False
            param.register_post_accumulate_grad_hook(self._backward_post_hook)
        if config.use_distributed_optimizer and config.overlap_param_gather:
            for submodule in self.module.modules():
                submodule.register_forward_pre_hook(self._forward_pre_hook)

    def _make_buffers(self, params: list[torch.nn.Parameter], group: Any, expert: bool) -> list[_ParamAndGradBuffer]:
        return [_ParamAndGradBuffer(self.ddp_config, param_dtype, grad_dtype, members, group, self.bucket_size,
                                    expert=expert)
                for (param_dtype, grad_dtype), members in self._group_params_for_buffers(params).items()]

    def _make_bucket_groups(self, buffers: list[_ParamAndGradBuffer], first_index: int,
                            gradient_scaling_factor: float | None) -> list[_ParamAndGradBucketGroup]:
        """One group per bucket, numbered from first_index. The forward pass needs the last bucket (first layers)
        first; each all-gather hands on to the one before."""
        groups = [_ParamAndGradBucketGroup([bucket], self.ddp_config, buffer.data_parallel_group, first_index + i,
                                           self.probes, gradient_scaling_factor)
                  for i, (buffer, bucket) in enumerate((buf, b) for buf in buffers for b in buf.buckets)]
        for later, earlier in zip(groups[1:], groups[:-1]):
            later.next_param_gather_bucket_group = earlier
        return groups

    def _group_params_for_buffers(self, params: list[torch.nn.Parameter]) -> dict[
            tuple[torch.dtype, torch.dtype], list[torch.nn.Parameter]]:
        groups: dict[tuple[torch.dtype, torch.dtype], list[torch.nn.Parameter]] = {}
        for param in params:
            grad_dtype = torch.float32 if self.ddp_config.grad_reduce_in_fp32 else param.dtype
            groups.setdefault((param.dtype, grad_dtype), []).append(param)
        return groups

    def _backward_post_hook(self, param: torch.nn.Parameter) -> None:
        # A weight the linear accumulated into main_grad itself has a placeholder grad (and the flag), unless it also
        # feeds a lookup that does not accumulate (zero_out_wgrad): then the grad is the lookup's, on zeros, and is
        # added too. One the lookup accumulated into main_grad has none (tensor_parallel/layers.py).
        if param.grad is not None and (not param.grad_added_to_main_grad or getattr(param, "zero_out_wgrad", False)):
            param.main_grad.add_(param.grad)
        param.grad_added_to_main_grad = False
        param.grad = None
        if self.ddp_config.overlap_grad_reduce:
            self.param_to_bucket_group[param].register_grad_ready(param)

    def _forward_pre_hook(self, module: torch.nn.Module, *unused: Any) -> None:
        """Wait only for the all-gathers of this module's own parameters; later layers' are still in flight.

        A wait that can block (an all-gather in flight, or owed and about to be issued) is a range of its own,
        category "dp-wait", nested in the forward range: the ledger takes it out of compute, so a forward that stalls
        on its all-gather is not counted as the all-gather's overlap. A DP group of one gathers nothing: no range."""
        for param in params_used_by_forward(module):
            group = self.param_to_bucket_group.get(param)
            if group is None:
                continue
            waits = group.dp_size > 1 and (bool(group.param_gather_handles) or not group.param_gather_dispatched)
            with self.probes.range(f"wait all-gather bucket{group.index}", "dp-wait", **group.attrs) \
                    if waits else nullcontext():
                group.finish_param_sync()

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def set_input_tensor(self, input_tensor: Any) -> None:
        """Pipeline stages receive their input from the previous stage, not through forward's arguments."""
        self.module.set_input_tensor(input_tensor)

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """Micro-batches inside only accumulate into main_grad; the one after issues the collectives."""
        for group in self.bucket_groups:
            group.is_last_microbatch = False
        try:
            yield
        finally:
            for group in self.bucket_groups:
                group.is_last_microbatch = True

    def start_grad_sync(self, *unused: Any) -> None:
        for group in self.bucket_groups:
            group.start_grad_sync()

    def finish_grad_sync(self) -> None:
        for group in self.bucket_groups:
            group.finish_grad_sync()

    def start_param_sync(self, *unused: Any, force_sync: bool = False) -> None:
        """All-gather the updated shards (distributed optimizer); replicas are already equal without it."""
        if not self.ddp_config.use_distributed_optimizer:
            return
        for group in self.bucket_groups:
            group.start_param_sync(force_sync=force_sync)

    def zero_grad_buffer(self) -> None:
        for buffer in self.buffers:
            buffer.reset()
        for group in self.bucket_groups:
            group.reset()

    def inventory(self) -> list[dict[str, Any]]:
        """Dense buffers as ddp.buffer{i}, expert ones as ddp.expert_buffer{j} (their records carry expert=True)."""
        dense = [b for b in self.buffers if not b.expert]
        expert = [b for b in self.buffers if b.expert]
        return ([record for i, buffer in enumerate(dense) for record in buffer.inventory(f"ddp.buffer{i}")] +
                [record for j, buffer in enumerate(expert) for record in buffer.inventory(f"ddp.expert_buffer{j}")])
