"""Forward-backward schedules, as Megatron Core's schedules.py: the training loop calls one function per step.

The schedule never imports DDP: it reaches the data-parallel machinery only through the callbacks on
`ScheduleConfig` (no_sync_func, grad_sync_func, param_sync_func, finalize_model_grads_func), so it runs unchanged
without DDP (tests, evaluation). With model chunks (interleaving) each callback is a list, one per chunk.
param_sync_func is used by the interleaved schedule only (chunk c + 1's all-gather is launched at chunk c's first
forward); without interleaving DDP's forward pre-hooks issue it, as in Megatron.

forward_step_func(data_iterator, model) -> (output_tensor, loss_func); on the last stage
loss_func(output_tensor) -> (loss, {"lm loss": detached loss}). The schedule divides the loss by the number of
micro-batches before backward so that accumulated gradients are the mean over the global batch.

The pipelined schedules execute schedule_plan's plan for this stage: the order of forwards and backwards and the
one P2P exchange after each step come from that pure function, which `train-ledger schedule` charts.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
from torch.autograd.variable import Variable

from engine.pipeline_parallel.p2p_communication import P2PCommunicator, p2p_tensor_shape
from engine.pipeline_parallel.schedule_plan import (
    BACKWARD,
    FORWARD,
    StagePlan,
    WorkItem,
    is_last_virtual_stage,
    stage_plan,
)
from probes.probe_set import NullProbeSet
from probes.protocol import ProbeSetProtocol


@dataclass
class ScheduleConfig:
    """Megatron's ModelParallelConfig fields that the schedules read.

    The pipelined schedules also need parallel_state (pipeline group and peers), the hidden size and the
    activation dtype; the exchanged shape is tensor_shape when given, else [seq/cp(/tp under sequence_parallel),
    micro_batch, hidden] from the seq_length / micro_batch_size the training loop passes."""
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    no_sync_func: Callable[[], Any] | list[Callable[[], Any]] | None = None
    grad_sync_func: Callable[..., None] | list[Callable[..., None]] | None = None
    param_sync_func: Callable[..., None] | list[Callable[..., None]] | None = None
    finalize_model_grads_func: Callable[[list[torch.nn.Module]], None] | None = None
    probes: ProbeSetProtocol = field(default_factory=NullProbeSet)
    parallel_state: Any = None
    hidden_size: int | None = None
    sequence_parallel: bool = False
    pipeline_dtype: torch.dtype = torch.float32
    tensor_shape: tuple[int, ...] | None = None


def _set_input_tensor(model: torch.nn.Module, input_tensor: torch.Tensor | None) -> None:
    """Hand the received activation to the chunk, through any wrapper (DDP keeps the chunk in .module)."""
    while not hasattr(model, "set_input_tensor"):
        model = model.module
    model.set_input_tensor(input_tensor)


def forward_step(forward_step_func, data_iterator, model, num_microbatches: int, config: ScheduleConfig,
                 losses: list[dict], microbatch: int, stage: int = 0, chunk: int = 0,
                 input_tensor: torch.Tensor | None = None, is_last_stage: bool = True) -> torch.Tensor:
    """Run one micro-batch through one chunk; on the last stage return the loss / num_microbatches."""
    with config.probes.range(f"forward stage{stage} mb{microbatch}", "forward", stage=stage, microbatch=microbatch,
                             chunk=chunk):
        if input_tensor is not None:
            _set_input_tensor(model, input_tensor)
        output_tensor, loss_func = forward_step_func(data_iterator, model)
        if is_last_stage and loss_func is not None:
            loss, reported = loss_func(output_tensor)
            output_tensor = loss / num_microbatches
            losses.append(reported)
    return output_tensor


def deallocate_output_tensor(output_tensor: torch.Tensor) -> None:
    """Free a sent activation's storage but keep the tensor, whose grad_fn the backward still needs: the next
    stage holds the data now, this stage only needs the graph."""
    assert output_tensor._base is None, "cannot deallocate a view: its base would keep the storage alive"
    output_tensor.data = torch.empty((1,), device=output_tensor.device, dtype=output_tensor.dtype)


def custom_backward(output_tensor: torch.Tensor, grad_output: torch.Tensor | None) -> None:
    """Backward from a possibly deallocated output: torch.autograd.backward checks that the gradient's shape
    matches the (now one-element) output, so call the autograd engine directly. grad_fn still has the real shape."""
    if grad_output is None:
        assert output_tensor.numel() == 1, "only a scalar loss may start the backward without a gradient"
        grad_output = torch.ones_like(output_tensor, memory_format=torch.preserve_format)
    Variable._execution_engine.run_backward(tensors=(output_tensor,), grad_tensors=(grad_output,), keep_graph=False,
                                            create_graph=False, inputs=(), allow_unreachable=True,
                                            accumulate_grad=True)


def backward_step(input_tensor: torch.Tensor | None, output_tensor: torch.Tensor,
                  output_tensor_grad: torch.Tensor | None, config: ScheduleConfig, microbatch: int, stage: int = 0,
                  chunk: int = 0) -> torch.Tensor | None:
    """Backward of one micro-batch through one chunk; returns the gradient of its input (None on the first stage)."""
    with config.probes.range(f"backward stage{stage} mb{microbatch}", "backward", stage=stage,
                             microbatch=microbatch, chunk=chunk):
        if input_tensor is not None:
            input_tensor.retain_grad()
        custom_backward(output_tensor, output_tensor_grad)
    return input_tensor.grad if input_tensor is not None else None


def forward_backward_no_pipelining(*, forward_step_func, data_iterator, model, num_microbatches: int,
                                   config: ScheduleConfig, forward_only: bool = False, **_unused) -> list[dict]:
    """Gradient accumulation over micro-batches; DP grad sync only on the last one (no_sync for the rest)."""
    no_sync = config.no_sync_func or contextlib.nullcontext
    losses: list[dict] = []

    def one(i: int) -> None:
        out = forward_step(forward_step_func, data_iterator, model, num_microbatches, config, losses, i)
        if not forward_only:
            backward_step(None, out, None, config, i)

    with no_sync():
        for i in range(num_microbatches - 1):
            one(i)
    one(num_microbatches - 1)
    if config.finalize_model_grads_func is not None and not forward_only:
        config.finalize_model_grads_func([model])
    return losses


class _GradSync:
    """When a pipeline stage launches each model chunk's DP grad reduction, as Megatron's schedules do
    (docs/engine.md, "Schedules"). Backwards are numbered k = 0, 1, ... in the order the stage runs them (Megatron's
    virtual micro-batch id) and all run under no_sync, except:

    - a chunk's last backward (micro-batch m - 1) runs with DDP's bucket hooks enabled when there is no
      grad_sync_func, or in 1F1B on stage 0: each bucket is issued as soon as its gradients are final and overlaps
      the rest of that backward (stage 0 is the one stage split into several buckets);
    - interleaved with grad_sync_func, after its k-th backward (before the step's P2P exchange) stage s launches the
      chunk whose last backward was its (k - s)-th: every stage launches a chunk's reduction at about the same time,
      so the slowdown asynchronous communication causes does not mismatch the stages' micro-batch times;
    - finish(), after the stage's last exchange, launches every chunk not launched yet through grad_sync_func. In
      1F1B these are the stages after the first (not split by bucket size): their reduction goes out in the bubble.
    A chunk is recorded as synchronized when launched either way, so no chunk is launched twice.
    """

    def __init__(self, config: ScheduleConfig, chunks: Sequence[torch.nn.Module], stage: int,
                 backwards: Sequence[WorkItem], num_microbatches: int):
        self.chunks, self.stage, self.num_microbatches = chunks, stage, num_microbatches
        self.no_sync = _per_chunk(config.no_sync_func, len(chunks))
        self.grad_sync = _per_chunk(config.grad_sync_func, len(chunks))
        self.has_grad_sync_func = config.grad_sync_func is not None
        self.interleaved = len(chunks) > 1
        self.hooks_in_last_backward = not self.has_grad_sync_func or (not self.interleaved and stage == 0)
        self.backwards = list(backwards)
        self.backward_id = {item: k for k, item in enumerate(self.backwards)}
        self.synchronized: set[int] = set()
        self.stack: contextlib.ExitStack | None = None

    def disable(self) -> None:
        if self.stack is None and any(self.no_sync):
            self.stack = contextlib.ExitStack()
            for no_sync in filter(None, self.no_sync):
                self.stack.enter_context(no_sync())

    def enable(self) -> None:
        if self.stack is not None:
            self.stack.close()
            self.stack = None

    def _is_last_of_chunk(self, k: int) -> bool:
        return self.backwards[k].microbatch == self.num_microbatches - 1

    def _launch(self, chunk: int) -> None:
        self.enable()
        self.grad_sync[chunk](self.chunks[chunk].parameters())
        self.synchronized.add(chunk)

    def backward(self, item: WorkItem, run_backward: Callable[[], torch.Tensor | None]) -> torch.Tensor | None:
        k = self.backward_id[item]
        if self.hooks_in_last_backward and self._is_last_of_chunk(k):
            self.enable()
            self.synchronized.add(item.chunk)
        input_grad = run_backward()
        if self.interleaved:
            j = k - self.stage  # Megatron's grad_sync_microbatch_id
            if self.has_grad_sync_func and j >= 0 and self._is_last_of_chunk(j):
                self._launch(self.backwards[j].chunk)
            self.disable()
        return input_grad

    def finish(self) -> None:
        """Megatron's "launch any remaining grad reductions"."""
        self.enable()
        for chunk in range(len(self.chunks)):
            if chunk not in self.synchronized and self.grad_sync[chunk] is not None:
                self._launch(chunk)


def _per_chunk(funcs: Callable | list[Callable] | None, num_chunks: int) -> list[Callable | None]:
    if isinstance(funcs, (list, tuple)):
        if len(funcs) != num_chunks:
            raise ValueError(f"{len(funcs)} callbacks for {num_chunks} model chunks")
        return list(funcs)
    if funcs is not None and num_chunks > 1:
        raise ValueError(f"one callback for {num_chunks} model chunks: pass one per chunk")
    return [funcs] * num_chunks


def _p2p_communicator(config: ScheduleConfig, seq_length: int | None, micro_batch_size: int | None,
                      device: torch.device) -> P2PCommunicator:
    shape = config.tensor_shape
    if shape is None:
        if None in (seq_length, micro_batch_size, config.hidden_size):
            raise ValueError("the P2P tensor shape needs ScheduleConfig.tensor_shape, or seq_length, "
                             "micro_batch_size and ScheduleConfig.hidden_size")
        # A CP rank's activation holds its s/cp tokens (Megatron's get_tensor_shapes).
        shape = p2p_tensor_shape(seq_length // config.parallel_state.cp_size, micro_batch_size, config.hidden_size,
                                 tensor_model_parallel_size=config.parallel_state.tp_size,
                                 sequence_parallel=config.sequence_parallel)
    return P2PCommunicator(config.parallel_state, shape, config.pipeline_dtype, device, config.probes)


def _run_stage_plan(plan: StagePlan, *, forward_step_func, data_iterators: list, chunks: list[torch.nn.Module],
                    num_microbatches: int, config: ScheduleConfig, p2p: P2PCommunicator,
                    forward_only: bool) -> list[dict]:
    """Execute this stage's plan: each step's items, then the step's one P2P exchange. Activations wait in
    per-chunk FIFOs for their backward; a sent activation keeps only its autograd shell."""
    ps = config.parallel_state
    p, stage, num_chunks = ps.pp_size, ps.pp_rank, len(chunks)
    losses: list[dict] = []
    inputs: list[list] = [[] for _ in chunks]
    outputs: list[list] = [[] for _ in chunks]
    grad_sync = _GradSync(config, chunks, stage, [item for item in plan.items if item.kind == BACKWARD],
                          num_microbatches)
    param_sync = _per_chunk(config.param_sync_func, num_chunks) if num_chunks > 1 else [None]
    if param_sync[0] is not None:
        param_sync[0](chunks[0].parameters())
    if not forward_only:
        grad_sync.disable()

    def run_forward(item: WorkItem, input_tensor: torch.Tensor | None) -> torch.Tensor:
        c = item.chunk
        if item.microbatch == 0 and c + 1 < num_chunks and param_sync[c + 1] is not None:
            param_sync[c + 1](chunks[c + 1].parameters())  # the next chunk's all-gather overlaps this chunk
        last = is_last_virtual_stage(p, stage, c, num_chunks)
        output = forward_step(forward_step_func, data_iterators[c], chunks[c], num_microbatches, config, losses,
                              item.microbatch, stage, c, input_tensor=input_tensor, is_last_stage=last)
        if not forward_only:
            inputs[c].append(input_tensor)
            outputs[c].append(output)
        return output

    def run_backward(item: WorkItem, output_grad: torch.Tensor | None) -> torch.Tensor | None:
        c = item.chunk
        input_tensor, output = inputs[c].pop(0), outputs[c].pop(0)
        return grad_sync.backward(item, lambda: backward_step(input_tensor, output, output_grad, config,
                                                              item.microbatch, stage, c))

    ex = plan.first_exchange
    activation, output_grad = p2p.send_forward_backward_recv_forward_backward(None, None, ex.recv_forward,
                                                                             ex.recv_backward)
    for step in plan.steps:
        sent_output = input_grad = None
        for item in step.items:
            if item.kind == FORWARD:
                sent_output = run_forward(item, activation)
            else:
                input_grad = run_backward(item, output_grad)
        ex = step.exchange
        activation, output_grad = p2p.send_forward_backward_recv_forward_backward(
            sent_output if ex.send_forward else None, input_grad if ex.send_backward else None,
            ex.recv_forward, ex.recv_backward)
        if ex.send_forward:
            deallocate_output_tensor(sent_output)
    if not forward_only:
        grad_sync.finish()
        if config.finalize_model_grads_func is not None:
            config.finalize_model_grads_func(list(chunks))
    return losses


def _stage_plan(config: ScheduleConfig, num_microbatches: int, num_chunks: int, forward_only: bool) -> StagePlan:
    ps = config.parallel_state
    if ps is None:
        raise ValueError("a pipelined schedule needs ScheduleConfig.parallel_state")
    return stage_plan(ps.pp_size, ps.pp_rank, num_microbatches, num_chunks, forward_only)


def _as_list(x: Any) -> list:
    return list(x) if isinstance(x, (list, tuple)) else [x]


def forward_backward_pipelining_without_interleaving(*, forward_step_func, data_iterator, model,
                                                     num_microbatches: int, config: ScheduleConfig,
                                                     forward_only: bool = False, seq_length: int | None = None,
                                                     micro_batch_size: int | None = None, **_unused) -> list[dict]:
    """1F1B: stage i runs min(p - i - 1, m) warmup forwards, then one forward / one backward, then the
    remaining backwards. Peak activations: p - i micro-batches on stage i instead of all m. Returns the
    micro-batch loss dicts (only the last stage has any)."""
    chunks = _as_list(model)
    if len(chunks) != 1:
        raise ValueError(f"the non-interleaved schedule runs one model chunk, got {len(chunks)}")
    plan = _stage_plan(config, num_microbatches, 1, forward_only)
    device = next(chunks[0].parameters()).device
    return _run_stage_plan(plan, forward_step_func=forward_step_func, data_iterators=[data_iterator],
                           chunks=chunks, num_microbatches=num_microbatches, config=config,
                           p2p=_p2p_communicator(config, seq_length, micro_batch_size, device),
                           forward_only=forward_only)


def forward_backward_pipelining_with_interleaving(*, forward_step_func, data_iterator, model,
                                                  num_microbatches: int, config: ScheduleConfig,
                                                  forward_only: bool = False, seq_length: int | None = None,
                                                  micro_batch_size: int | None = None, **_unused) -> list[dict]:
    """Interleaved 1F1B over V model chunks per stage (virtual stage c * p + i), cutting the bubble by V at the
    cost of V times more P2P exchanges. model and data_iterator are lists, one per chunk (a single iterator is
    shared by all chunks). Needs num_microbatches to be a multiple of the pipeline size."""
    chunks = _as_list(model)
    iterators = _as_list(data_iterator)
    if len(iterators) == 1:
        iterators = iterators * len(chunks)
    if len(iterators) != len(chunks):
        raise ValueError(f"{len(iterators)} data iterators for {len(chunks)} model chunks")
    plan = _stage_plan(config, num_microbatches, len(chunks), forward_only)
    device = next(chunks[0].parameters()).device
    return _run_stage_plan(plan, forward_step_func=forward_step_func, data_iterators=iterators, chunks=chunks,
                           num_microbatches=num_microbatches, config=config,
                           p2p=_p2p_communicator(config, seq_length, micro_batch_size, device),
                           forward_only=forward_only)


def get_forward_backward_func(pipeline_model_parallel_size: int = 1,
                              virtual_pipeline_model_parallel_size: int | None = None):
    if pipeline_model_parallel_size == 1:
        return forward_backward_no_pipelining
    if virtual_pipeline_model_parallel_size is not None and virtual_pipeline_model_parallel_size > 1:
        return forward_backward_pipelining_with_interleaving
    return forward_backward_pipelining_without_interleaving
