"""The engine handed to the probes: what the start-up sweeps and the inventory need of the model, the optimizer and
the parallel layout, so that engine/training.py only trains.

    probes.inventory(inventory(model, optimizer))
    collective_sweep(model, run_config, parallel_state, probes)      # the sizes this run communicates
    compute_sweep(model, optimizer, run_config, parallel_state, device, probes)   # this rank's catalogue (common/ops)
    probes.host_sweep(pass_timer(model, run_config, parallel_state, device))      # the host, and the model's passes

The compute sweep times the engine's own functions (engine_kernels): its fused functions, its weight-gradient
accumulation, its MoE layer's router and dispatcher, its ring attention; probes/compute_sweep/handles.py says what
each handle is.
"""
from __future__ import annotations

import functools
import statistics
import time
from typing import Any, Callable

import torch

from common.config import RunConfig
from common.config.implementation_config import FLASH
from common.ops import host
from engine.distributed import DistributedDataParallel
from engine.fp8_utils import fp8_matmul, layer_linears
from engine.jit import COMPILE_DEVICE_TYPES
from engine.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from engine.parallel_state import ParallelState
from engine.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from engine.tensor_parallel.layers import (
    accumulate_embedding_grad,
    accumulate_weight_grad,
    drop_delayed_weight_grads,
)
from engine.tensor_parallel.mappings import TPGroup
from engine.transformer.attention import SelfAttention, scaled_dot_product, split_qkv_and_rotate
from engine.transformer.mlp import swiglu, swiglu_any_rows
from engine.transformer.moe.expert_parallel import EPGroup
from engine.transformer.moe.experts import GroupedMLP
from engine.transformer.moe.grouped_gemm_util import grouped_linear as moe_grouped_linear
from engine.transformer.moe.moe_layer import MoELayer, moe_step_figures
from engine.transformer.moe.router import Routing
from engine.transformer.moe.token_dispatcher import MoEAlltoAllTokenDispatcher
from engine.transformer.ring_attention import (
    CPGroup,
    block_kernels,
    ring_backward,
    ring_forward,
)
from probes.compute_sweep import EngineKernels, MoEKernels, RingKernels
from probes.protocol import ProbeSetProtocol


def inventory(model: list[DistributedDataParallel], optimizer) -> list[dict[str, Any]]:
    """What the engine holds, for the inventory events: every chunk's parameters and grad buffers, the optimizer's
    state."""
    return [record for chunk in model for record in chunk.inventory()] + list(optimizer.inventory())


def collective_sweep(model: list[DistributedDataParallel], run_config: RunConfig, parallel_state: ParallelState,
                     probes: ProbeSetProtocol) -> None:
    """The start-up bandwidth sweep (a no-op unless --bandwidth-sweep) at the sizes this run communicates: its dense
    and expert DP buckets; the [s/cp(/tp), b, h] activation that TP collectives and pipeline sends carry (a CP rank
    holds s/cp tokens); an MoE layer's dispatch of those tokens, k rows each (uniform routing: the size, not the
    split); the CP ring's messages, the [2, b, n_kv/tp, s/cp, d] K/V block and, in backward, that block with the
    previous block's dK/dV (engine/transformer/ring_attention.py)."""
    buffers = [buffer for chunk in model for buffer in chunk.buffers]
    m, mbs, p = run_config.model, run_config.train.micro_batch_size, parallel_state
    tokens = m.seq_length // p.cp_size // (p.tp_size if run_config.parallel.sequence_parallel else 1) * mbs
    kv_block = 2 * mbs * (m.num_query_groups // p.tp_size) * (m.seq_length // p.cp_size) * m.head_dim
    probes.collective_sweep(parallel_state,
                            dp_bucket_numels=[b.grad_data.numel() for buffer in buffers if not buffer.expert
                                              for b in buffer.buckets],
                            expert_bucket_numels=[b.grad_data.numel() for buffer in buffers if buffer.expert
                                                  for b in buffer.buckets],
                            dp_grad_dtype=buffers[0].grad_dtype, dp_param_dtype=buffers[0].param_dtype,
                            activation_numel=tokens * m.hidden_size, activation_dtype=buffers[0].param_dtype,
                            ep_dispatch_numel=tokens * m.moe_router_topk * m.hidden_size if m.is_moe else 0,
                            cp_message_numels=[kv_block, 2 * kv_block] if p.cp_size > 1 else [])


def moe_kernels(model: list[torch.nn.Module]) -> MoEKernels | None:
    """The sweep's handles on this rank's first MoE layer (None for a dense model): its router after the GEMM, a
    dispatcher of the same experts at EP 1 (permute and combine without the all-to-alls), the experts' SwiGLU and,
    under --moe-grouped-gemm, their grouped GEMM."""
    layer = next((m for chunk in model for m in chunk.modules() if isinstance(m, MoELayer)), None)
    if layer is None:
        return None
    local = MoEAlltoAllTokenDispatcher(layer.token_dispatcher.num_experts, EPGroup(group=None, size=1, rank=0),
                                       layer.layer_number)

    def route(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        routing = layer.router.route(logits)
        return routing.experts, routing.probs

    def permute(tokens: torch.Tensor, experts: torch.Tensor, probs: torch.Tensor, kept: torch.Tensor):
        none = torch.zeros(local.num_experts, dtype=torch.long, device=tokens.device)
        return local.dispatch(tokens, Routing(experts=experts, probs=probs, kept=kept, tokens_per_expert=none,
                                              dropped_per_expert=none, aux_loss=probs.new_zeros(())))

    def grouped_linear(rows: torch.Tensor, weights: list[torch.Tensor], counts: torch.Tensor) -> torch.Tensor:
        return moe_grouped_linear(rows, weights, layer.experts.groups(rows.shape[0], counts))

    return MoEKernels(route=route, permute=permute, unpermute=local.combine, swiglu=swiglu_any_rows,
                      grouped_linear=grouped_linear if isinstance(layer.experts, GroupedMLP) else None)


def engine_kernels(model: list[torch.nn.Module], vocab_size: int, device: torch.device,
                   wgrad_fusion: bool = True) -> EngineKernels:
    """What the compute sweep times: the engine's own fused functions as they run here (compiled or eager), its
    weight-gradient accumulation (gradient-accumulation fusion where this device has it; without `wgrad_fusion`
    the sweep times the 16-bit GEMM DDP's hook adds after), the MoE layer's ops (None
    without an MoE layer in `model`), ring attention's blocks and loops (on a ring with no process group: no
    exchange), the loss over `vocab_size` real entries on a TP group of one, so it issues no collective; core
    attention on the layers' --attention-backend kernel; under --fp8-format the layers' float8 matmul (the recipe
    their linears carry)."""
    recipes = {getattr(linear, "fp8", None) for chunk in model for linear in layer_linears(chunk)} - {None}
    backends = {m.attention_backend for chunk in model for m in chunk.modules() if isinstance(m, SelfAttention)}
    return EngineKernels(
        split_qkv_and_rotate=split_qkv_and_rotate, swiglu=swiglu, wgrad=accumulate_weight_grad,
        embedding_grad=accumulate_embedding_grad, clip=clip_grad_by_total_norm_fp32,
        cross_entropy=functools.partial(vocab_parallel_cross_entropy, tp=TPGroup(group=None, size=1, rank=0),
                                        vocab_size=vocab_size),
        core_attention=functools.partial(scaled_dot_product, backend=backends.pop() if backends else FLASH),
        variant="compiled" if device.type in COMPILE_DEVICE_TYPES else "eager",
        wgrad_fusion=wgrad_fusion, moe=moe_kernels(model),
        ring=RingKernels(blocks=block_kernels, forward=ring_forward, backward=ring_backward,
                         group=functools.partial(CPGroup, None, rank=0, next_rank=None, prev_rank=None)),
        fp8_linear=fp8_matmul(*recipes) if recipes else None)


def compute_sweep(model: list[DistributedDataParallel], optimizer, run_config: RunConfig,
                  parallel_state: ParallelState, device: torch.device, probes: ProbeSetProtocol) -> None:
    """The start-up compute sweep (a no-op unless --compute-sweep) at this rank's shapes (engine_kernels)."""
    kernels = engine_kernels(model, run_config.model.vocab_size, device,
                             run_config.implementation.gradient_accumulation_fusion)
    probes.compute_sweep(run_config, first_stage=parallel_state.is_pipeline_first_stage,
                         last_stage=parallel_state.is_pipeline_last_stage,
                         optimizer_numel=sum(p.numel() for p in optimizer.main_params),
                         grad_buffer_numel=sum(b.numel for chunk in model for b in chunk.buffers), kernels=kernels)


PASS_WARMUP, PASS_REPEATS = 2, 5


def _timed_pass(chunk: DistributedDataParallel, tokens: torch.Tensor, device: torch.device,
                idle_s: float = 0.0) -> tuple[float, float]:
    """(forward, backward) host seconds to issue one pass, the device drained before each and, before the forward,
    the host asleep for idle_s."""
    torch.cuda.synchronize(device)
    time.sleep(idle_s)
    start = time.perf_counter()
    loss = chunk(tokens, tokens)
    issued = time.perf_counter()
    torch.cuda.synchronize(device)
    begin = time.perf_counter()
    torch.autograd.backward(loss, torch.ones_like(loss))
    backward = time.perf_counter() - begin
    drop_delayed_weight_grads(chunk)  # --moe-delay-expert-wgrad's held operands: no step flushes these
    return issued - start, backward


def pass_timer(model: list[DistributedDataParallel], run_config: RunConfig, parallel_state: ParallelState,
               device: torch.device) -> Callable[[], dict[str, float]] | None:
    """What times the host's issue of one micro-batch's forward (tokens to the per-token loss) and backward of this
    rank's model at the run's shapes, each the median of PASS_REPEATS after PASS_WARMUP (which compile), the device
    drained before each and never waited for inside, under no_sync (no gradient reduction); then the forward again
    with the host asleep for IDLE_BEFORE_PASS_S first (a step's first micro-batch); the gradients it leaves are
    cleared. An MoE model's passes' routing counts and delayed expert operands are dropped with the gradients, and
    its backward alone is timed where the forward waits for the device (SequentialMLP's dispatcher reads the
    counts; --moe-grouped-gemm keeps them on the device at EP 1). None where a pass cannot
    run alone or waits for the device: a CPU rank, a pipeline stage (its input is another stage's), context
    parallelism, expert parallelism (its all-to-alls wait for the peers), the per-module all-gather waits of
    --overlap-param-gather where there is a peer to gather from (a data-parallel group of one gathers nothing)."""
    p, t, m = parallel_state, run_config.train, run_config.model
    if (device.type != "cuda" or p.pp_size > 1 or len(model) > 1 or p.cp_size > 1 or p.ep_size > 1
            or (t.overlap_param_gather and p.dp_size > 1)):
        return None
    (chunk,) = model
    backward_alone = m.is_moe and not m.moe_grouped_gemm

    def measure() -> dict[str, float]:
        # any valid ids, drawn without the generators training uses
        tokens = torch.arange(t.micro_batch_size * m.seq_length, device=device).remainder(m.vocab_size)
        tokens = tokens.view(t.micro_batch_size, m.seq_length)
        with chunk.no_sync():
            warm = [_timed_pass(chunk, tokens, device) for _ in range(PASS_WARMUP + PASS_REPEATS)][PASS_WARMUP:]
            after_idle = [] if backward_alone else [
                _timed_pass(chunk, tokens, device, idle_s=host.IDLE_BEFORE_PASS_S) for _ in range(PASS_REPEATS)]
        torch.cuda.synchronize(device)
        chunk.zero_grad_buffer()
        moe_step_figures([chunk])  # taken and dropped (nothing for a dense model): these forwards are no step's
        if backward_alone:
            return {host.PASS_BACKWARD: statistics.median(b for _, b in warm)}
        return {host.PASS_FORWARD: statistics.median(f for f, _ in warm),
                host.PASS_BACKWARD: statistics.median(b for _, b in warm),
                host.PASS_FORWARD_AFTER_IDLE: statistics.median(f for f, _ in after_idle)}

    return measure
