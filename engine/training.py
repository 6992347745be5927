"""The training loop, as Megatron's training/training.py: pretrain -> train -> train_step, and training_log.

pretrain() builds the model chunks (one per virtual pipeline stage, each wrapped in DistributedDataParallel), the
optimizer, its learning-rate scheduler and the data iterators; train() hands DDP's callbacks to the schedule through
ScheduleConfig and loops over train_step(). The schedule never sees DDP, only the callbacks (docs/engine.md,
"Schedules").

The step keeps the host out of the device's way: the micro-batch losses are reduced on device (averaged over the
data-parallel group, broadcast from the last pipeline stage) and read back once, at the end of the step.
"""
from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from common.config import RunConfig
from engine.checkpointing import Checkpointer
from engine.data import MicroBatch, build_data_iterators, data_wait_figures
from engine.distributed import DistributedDataParallel, finalize_model_grads
from engine.model_builder import get_model, held_tensors
from engine.optimizer import MegatronOptimizer, get_megatron_optimizer
from engine.optimizer.optimizer_param_scheduler import OptimizerParamScheduler
from engine.parallel_state import ParallelState
from engine.pipeline_parallel.schedules import ScheduleConfig, get_forward_backward_func
from engine.probe_adapters import collective_sweep, compute_sweep, inventory, pass_timer
from engine.tensor_parallel.layers import pad_vocab_size
from engine.transformer.cuda_graphs import capture_layer_graphs
from engine.transformer.moe.moe_layer import moe_step_figures
from probes.probe_set import NullProbeSet
from probes.protocol import ProbeSetProtocol


@dataclass
class StepLog:
    iteration: int  # 1-based, as Megatron logs it
    loss: float  # mean over the global batch
    lr: float  # the learning rate this step's update used
    grad_norm: float  # before clipping
    step_time_s: float
    tokens_per_s: float
    tflops_per_gpu: float  # num_floating_point_operations / step time / world size: Megatron's "throughput"


@dataclass
class TrainResult:
    steps: list[StepLog] = field(default_factory=list)
    model: list[torch.nn.Module] = field(default_factory=list)


def num_floating_point_operations(run_config: RunConfig, batch_size: int) -> float:
    """Model FLOPs of one global batch, in Megatron's training.py form: 12 B s L h^2 times the per-layer GEMM widths
    over h (attention projections, the causal half of the s x s attention, SwiGLU's 3/2 wider MLP) plus the logit
    GEMM spread over the layers. 12 = 3 (forward, wgrad, dgrad) x 2 (each matrix appears in a pair of GEMMs) x 2
    (multiply-add). The ledger derives the same count term by term (docs/formulas.md, "FLOPs"); a test holds the
    two equal."""
    m, tp = run_config.model, run_config.parallel.tensor_model_parallel_size
    h, s, layers = m.hidden_size, m.seq_length, m.num_layers
    query_projection_ratio = m.num_attention_heads * m.head_dim / h
    attention = (1 + m.num_query_groups / m.num_attention_heads + s / h / 2) * query_projection_ratio
    mlp = m.ffn_hidden_size / h * 3 / 2  # SwiGLU: gate and up projections, then down
    if m.is_moe:  # Megatron's moe_layer_flops: each token runs top-k experts of their own width (the router uncounted)
        mlp = m.expert_ffn_hidden_size * m.moe_router_topk / h * 3 / 2
    logit = pad_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp) / (2 * layers * h)
    return 12 * batch_size * s * layers * h * h * (attention + mlp + logit)


def _one_or_list(items: list):
    """Megatron's convention: a single-chunk model gets the callable itself, an interleaved one the list."""
    return items[0] if len(items) == 1 else items


def build_schedule_config(run_config: RunConfig, model: list[DistributedDataParallel],
                          parallel_state: ParallelState, probes: ProbeSetProtocol) -> ScheduleConfig:
    train = run_config.train
    return ScheduleConfig(
        pipeline_model_parallel_size=parallel_state.pp_size,
        virtual_pipeline_model_parallel_size=parallel_state.virtual_pipeline_size,
        no_sync_func=_one_or_list([chunk.no_sync for chunk in model]),
        grad_sync_func=_one_or_list([chunk.start_grad_sync for chunk in model]) if train.overlap_grad_reduce else None,
        param_sync_func=(_one_or_list([chunk.start_param_sync for chunk in model])
                         if train.overlap_param_gather else None),
        finalize_model_grads_func=functools.partial(finalize_model_grads, parallel_state=parallel_state, probes=probes),
        probes=probes, parallel_state=parallel_state, hidden_size=run_config.model.hidden_size,
        sequence_parallel=run_config.parallel.sequence_parallel,
        pipeline_dtype=torch.bfloat16 if train.bf16 else torch.float32)


def loss_func(per_token_loss: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The micro-batch's loss, averaged over its tokens (mock data has no loss mask)."""
    loss = per_token_loss.float().mean()
    return loss, {"lm loss": loss.detach()}


def forward_step(data_iterator, model: torch.nn.Module):
    batch: MicroBatch = next(data_iterator)
    output = model(batch.tokens, batch.labels)
    return output, (loss_func if batch.labels is not None else None)


def reduce_loss(losses: list[dict[str, torch.Tensor]], parallel_state: ParallelState,
                device: torch.device, probes: ProbeSetProtocol = NullProbeSet()) -> torch.Tensor:
    """The global batch's mean loss on every rank, without leaving the device: micro-batches have equal token
    counts, and so have the CP ranks' shares of a sequence, so the mean of the micro-batch means, averaged over
    dp x cp (Megatron's dp_cp group), is the mean over the global batch."""
    ps = parallel_state
    if ps.is_pipeline_last_stage:
        loss = torch.stack([d["lm loss"] for d in losses]).mean()
        if ps.dp_size * ps.cp_size > 1:
            with probes.range("all-reduce loss", "dp-comm"):  # over dp x cp, as the grads; no bytes: not theirs
                dist.all_reduce(loss, group=ps.groups["dp_cp"])
            loss = loss / (ps.dp_size * ps.cp_size)
    else:
        loss = torch.zeros((), device=device)
    if ps.pp_size > 1:
        with probes.range("broadcast loss", "pp-comm"):  # no bytes: not the pipeline's point-to-point volume
            dist.broadcast(loss, src=ps.ranks["pp"][-1], group=ps.groups["pp"])
    return loss


def train_step(forward_step_func: Callable, data_iterators: list, model: list[DistributedDataParallel], optimizer,
               scheduler: OptimizerParamScheduler, config: ScheduleConfig, run_config: RunConfig,
               parallel_state: ParallelState, device: torch.device):
    """One global batch: zero the grad buffers, forward/backward every micro-batch, step the optimizer and the lr.
    Returns (loss tensor on device, update_successful, grad_norm)."""
    for chunk in model:
        chunk.zero_grad_buffer()
    optimizer.zero_grad()
    forward_backward_func = get_forward_backward_func(parallel_state.pp_size, parallel_state.virtual_pipeline_size)
    losses = forward_backward_func(forward_step_func=forward_step_func, data_iterator=_one_or_list(data_iterators),
                                   model=_one_or_list(model), num_microbatches=run_config.num_microbatches,
                                   seq_length=run_config.model.seq_length,
                                   micro_batch_size=run_config.train.micro_batch_size, config=config)
    with config.probes.range("optimizer", "optimizer"):
        update_successful, grad_norm = optimizer.step()
    scheduler.step()
    return reduce_loss(losses, parallel_state, device, config.probes), update_successful, grad_norm


def training_log(step: StepLog, train_iters: int) -> None:
    print(f" iteration {step.iteration:>8}/{train_iters:>8} | lm loss: {step.loss:.6E} | learning rate: "
          f"{step.lr:.6E} | grad norm: {step.grad_norm:.4f} | tokens/s: {step.tokens_per_s:,.0f} | "
          f"step time (ms): {step.step_time_s * 1e3:.1f} | throughput per GPU (TFLOP/s/GPU): {step.tflops_per_gpu:.4g}",
          flush=True)


def train(forward_step_func: Callable, model: list[DistributedDataParallel], optimizer,
          scheduler: OptimizerParamScheduler, data_iterators: list, run_config: RunConfig,
          parallel_state: ParallelState, device: torch.device, probes: ProbeSetProtocol, checkpointer: Checkpointer, *,
          log: bool) -> list[StepLog]:
    """Iterations after the checkpoint loaded (if any) up to --train-iters; the checkpointer saves when due and
    stops the loop at --exit-interval or --exit-duration-in-mins."""
    start_iteration = checkpointer.load()
    config = build_schedule_config(run_config, model, parallel_state, probes)
    train = run_config.train
    tokens_per_step = train.global_batch_size * run_config.model.seq_length
    flops_per_gpu_step = (num_floating_point_operations(run_config, train.global_batch_size)
                          / parallel_state.world_size)
    steps: list[StepLog] = []
    for iteration in range(start_iteration + 1, train.train_iters + 1):
        probes.step_begin(iteration)
        lr = optimizer.param_groups[0]["lr"]
        start = time.perf_counter()
        with probes.range("iteration", "iteration"):
            loss, _, grad_norm = train_step(forward_step_func, data_iterators, model, optimizer, scheduler, config,
                                            run_config, parallel_state, device)
            loss_value = loss.item()  # the step's one host synchronisation
        step_time = time.perf_counter() - start
        step = StepLog(iteration=iteration, loss=loss_value, lr=lr, grad_norm=float(grad_norm),
                       step_time_s=step_time, tokens_per_s=tokens_per_step / step_time,
                       tflops_per_gpu=flops_per_gpu_step / step_time / 1e12)
        steps.append(step)
        probes.step_end(iteration, loss=step.loss, lr=step.lr, grad_norm=step.grad_norm, tokens=tokens_per_step,
                        step_time_s=step.step_time_s, throughput=step.tflops_per_gpu,
                        **data_wait_figures(data_iterators),  # the step's wait for data (docs/engine.md)
                        **moe_step_figures(model))  # routing counts per expert (docs/engine.md, "Mixture of experts")
        if iteration == start_iteration + 1:
            probes.memory_point("after_first_step", lambda: held_tensors(model, optimizer))
        if log and iteration % train.log_interval == 0:
            training_log(step, train.train_iters)
        if checkpointer.after_step(iteration):
            break
    checkpointer.finish()  # an --async-save still writing: on disk (and finalised) before training returns
    for chunk in model:  # under --overlap-param-gather the last update's all-gather is owed to a next step
        chunk.start_param_sync(force_sync=True)
    return steps


def setup_model_and_optimizer(run_config: RunConfig, parallel_state: ParallelState, device: torch.device,
                              probes: ProbeSetProtocol) -> tuple[list[DistributedDataParallel], MegatronOptimizer,
                                                                 OptimizerParamScheduler]:
    """Megatron's setup_model_and_optimizer: the model chunks in DDP, the optimizer over their buffers and its
    schedule; the probes' memory point after the optimizer and the inventory of what they hold."""
    model = get_model(run_config, parallel_state, device, probes)
    optimizer = get_megatron_optimizer(run_config.train, model, parallel_state)
    scheduler = OptimizerParamScheduler.from_train_config(optimizer, run_config.train)
    probes.memory_point("after_optimizer_init", lambda: held_tensors(model, optimizer))
    probes.inventory(inventory(model, optimizer))
    return model, optimizer, scheduler


def pretrain(run_config: RunConfig, parallel_state: ParallelState, device: torch.device,
             probes: ProbeSetProtocol | None = None, *, forward_step_func: Callable = forward_step,
             log: bool = False) -> TrainResult:
    probes = probes if probes is not None else NullProbeSet()
    model, optimizer, scheduler = setup_model_and_optimizer(run_config, parallel_state, device, probes)
    collective_sweep(model, run_config, parallel_state, probes)
    compute_sweep(model, optimizer, run_config, parallel_state, device, probes)
    if run_config.implementation.graphed_layers:  # after the compute sweep, which times the layers' kernels eagerly
        capture_layer_graphs(model, run_config, device, probes)
    probes.host_sweep(pass_timer(model, run_config, parallel_state, device))  # the passes as they will run
    data_iterators = build_data_iterators(run_config, parallel_state, device, probes)
    checkpointer = Checkpointer(run_config, model, optimizer, scheduler, data_iterators, log=log, probes=probes)
    steps = train(forward_step_func, model, optimizer, scheduler, data_iterators, run_config, parallel_state,
                  device, probes, checkpointer, log=log)
    for iterator in data_iterators:  # stop the loaders' threads and what they built ahead
        iterator.close()
    return TrainResult(steps=steps, model=model)
