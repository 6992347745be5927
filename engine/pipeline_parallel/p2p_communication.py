"""Point-to-point between pipeline stages, as Megatron Core's P2PCommunicator.

An exchange is one torch.distributed.batch_isend_irecv call: a stage in the 1F1B steady state sends its activation
and receives the next gradient in a single exchange, so neighbours meet once per step instead of twice
(docs/engine.md, "Schedules"). Peers are global ranks (the next / previous rank of this rank's pipeline group, wrapping
around so that, interleaved, the last stage's chunk c feeds the first stage's chunk c + 1).

Ops are posted in one fixed order (send next, recv prev, send prev, recv next). With a pipeline of two, next and prev
are the same rank and both directions share one channel; schedule_plan's plans send and receive the two kinds in the
same order on both ends (tests/test_schedule_plan.py checks it), so no tags are needed and NCCL, which has none, matches
them too.

Received tensors are fresh buffers of the configured shape: [s, b, h], or [s/tp, b, h] under sequence parallelism.
Nothing here synchronises the device: waiting on the requests orders the exchange against later kernels.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.distributed as dist

from probes.probe_set import NullProbeSet
from probes.protocol import ProbeSetProtocol


def p2p_tensor_shape(seq_length: int, micro_batch_size: int, hidden_size: int, *, tensor_model_parallel_size: int = 1,
                     sequence_parallel: bool = False) -> tuple[int, int, int]:
    """The activation exchanged between stages: sequence first; sequence parallelism keeps s/tp per rank."""
    if sequence_parallel:
        seq_length //= tensor_model_parallel_size
    return seq_length, micro_batch_size, hidden_size


class P2PCommunicator:
    def __init__(self, parallel_state: Any, tensor_shape: Sequence[int], dtype: torch.dtype,
                 device: torch.device | str, probes: ProbeSetProtocol | None = None):
        self.group = parallel_state.groups["pp"]
        self.next_rank = parallel_state.pipeline_next_rank
        self.prev_rank = parallel_state.pipeline_prev_rank
        self.tensor_shape = tuple(tensor_shape)
        self.dtype = dtype
        self.device = torch.device(device)
        self.probes = probes if probes is not None else NullProbeSet()

    def _buffer(self, requires_grad: bool) -> torch.Tensor:
        return torch.empty(self.tensor_shape, dtype=self.dtype, device=self.device, requires_grad=requires_grad)

    def _communicate(self, name: str, *, send_next: torch.Tensor | None = None,
                     send_prev: torch.Tensor | None = None, recv_prev: bool = False,
                     recv_next: bool = False) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(activation from prev, gradient from next). A received activation requires grad: the backward step
        reads its .grad as the gradient to send back."""
        from_prev = self._buffer(requires_grad=True) if recv_prev else None
        from_next = self._buffer(requires_grad=False) if recv_next else None
        ops = []
        if send_next is not None:
            ops.append(dist.P2POp(dist.isend, self._outgoing(send_next), self.next_rank, self.group))
        if from_prev is not None:
            ops.append(dist.P2POp(dist.irecv, from_prev, self.prev_rank, self.group))
        if send_prev is not None:
            ops.append(dist.P2POp(dist.isend, self._outgoing(send_prev), self.prev_rank, self.group))
        if from_next is not None:
            ops.append(dist.P2POp(dist.irecv, from_next, self.next_rank, self.group))
        if not ops:
            return None, None
        nbytes = sum(op.tensor.numel() * op.tensor.element_size() for op in ops)
        with self.probes.range(name, "pp-comm", bytes=nbytes, next_rank=self.next_rank, prev_rank=self.prev_rank):
            for request in dist.batch_isend_irecv(ops):
                request.wait()
        return from_prev, from_next

    def _outgoing(self, tensor: torch.Tensor) -> torch.Tensor:
        if tuple(tensor.shape) != self.tensor_shape:
            raise ValueError(f"P2P send of shape {tuple(tensor.shape)}, the pipeline exchanges {self.tensor_shape}")
        return tensor.detach().contiguous()

    def send_forward_backward_recv_forward_backward(
            self, output_tensor: torch.Tensor | None, input_tensor_grad: torch.Tensor | None, recv_prev: bool,
            recv_next: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Any combination of sends and receives in one call, what the schedules execute for a plan's exchange; the
        probe range is named after what actually moves, in Megatron's names (send_forward_recv_backward, ...)."""
        sends = [kind for kind, t in (("forward", output_tensor), ("backward", input_tensor_grad)) if t is not None]
        recvs = [kind for kind, flag in (("forward", recv_prev), ("backward", recv_next)) if flag]
        name = "_".join(part for part in ("send_" + "_".join(sends) if sends else "",
                                          "recv_" + "_".join(recvs) if recvs else "") if part)
        return self._communicate(name, send_next=output_tensor, send_prev=input_tensor_grad, recv_prev=recv_prev,
                                 recv_next=recv_next)
