"""Tensor-parallel layers, as Megatron's tensor_parallel/layers.py: no biases, activations [s, b, h].

A sharded parameter is a plain nn.Parameter of the local shape that carries Megatron's attributes
`tensor_model_parallel=True`, `partition_dim`, `partition_stride`; gradient clipping, checkpointing and the ledger's
inventory read them to tell a shard from a TP-replicated parameter.

Every parallel linear's GEMMs run in `_LinearWithGradAccumulation` (Megatron's
LinearWithGradAccumulationAndAsyncCommunication), which does three things F.linear's autograd cannot:

- sequence parallelism: the input of a ColumnParallelLinear is [s/tp, b, h]; the function all-gathers it for the
  GEMM but saves only the *local* shard, gathering it again in backward (saving the gathered input would keep tp
  times the activation memory that sequence parallelism exists to save);
- gradient accumulation fusion (Megatron's --gradient-accumulation-fusion): when DDP owns the weight's gradient,
  dL/dW is added into DDP's fp32 `main_grad` by the weight-gradient GEMM itself (beta = 1, fp32 output from 16-bit
  inputs) instead of being written as a 16-bit tensor that DDP's hook reads back and adds: per micro-batch that
  saves the hook's pass over every weight's gradient (~12 GB of memory traffic for 1.5 B parameters in bf16) and
  rounds the product once (to fp32) instead of twice. Megatron's --no-gradient-accumulation-fusion turns it off:
  each weight then carries `gradient_accumulation_fusion = False` (set_gradient_accumulation_fusion).

- a delayed weight gradient (this engine's --moe-delay-expert-wgrad, for the experts): a weight marked by
  `delay_weight_grad` has its backward's two operands held instead of its wgrad GEMM run, and
  `flush_delayed_weight_grads` adds dL/dW for all of them at once after the last micro-batch: one GEMM whose
  reduction runs over every micro-batch's rows, where an expert sees ~T k / E rows a micro-batch. A grouped GEMM's
  expert holds the whole operands and its rows' range as a function (`HeldOperands.rows`), read at the flush: the
  split is counts the host learns from a device copy, and reading it in backward would hold the host there until the
  device had caught up with the forward that made them.

The embedding's lookup does the same for its weight (this engine's, not Megatron's, which lets autograd build the
dense [V, h] gradient): its backward adds the looked-up rows' gradients into main_grad (index_put_, accumulating)
and hands autograd no gradient, so the dense gradient, its zeroing and DDP's pass over it are never made.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from engine.fp8_utils import Fp8Recipe, fp8_matmul
from engine.tensor_parallel.mappings import (
    TPGroup,
    _all_gather,
    _reduce_scatter_dim0,
    copy_to_tensor_model_parallel_region,
    gather_from_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_model_parallel_region,
)
from engine.tensor_parallel.random import MasterWeightInit, sharded_master_weight


def set_tensor_model_parallel_attributes(param: torch.nn.Parameter, is_parallel: bool, dim: int | None,
                                         stride: int) -> None:
    param.tensor_model_parallel = is_parallel
    param.partition_dim = dim if dim is not None else -1
    param.partition_stride = stride


def pad_vocab_size(vocab_size: int, make_vocab_size_divisible_by: int, tp_size: int) -> int:
    """Megatron's _vocab_size_with_padding: round up to a multiple of divisible_by x TP, so every TP rank holds an
    equal, aligned slice of the embedding and the output layer."""
    multiple = make_vocab_size_divisible_by * tp_size
    return -(-vocab_size // multiple) * multiple


def _sharded_parameter(init: MasterWeightInit, full_shape: tuple[int, int], partition_dim: int, stride: int,
                       tp: TPGroup, params_dtype: torch.dtype, device: torch.device) -> torch.nn.Parameter:
    weight = torch.nn.Parameter(sharded_master_weight(init, full_shape, partition_dim=partition_dim, stride=stride,
                                                      rank=tp.rank, size=tp.size, dtype=params_dtype,
                                                      device=device))
    set_tensor_model_parallel_attributes(weight, True, partition_dim, stride)
    return weight


def addmm_into(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """c += a @ b in one GEMM (beta = 1), accumulating in c's dtype even when a and b are 16-bit."""
    if c.dtype == a.dtype:
        c.addmm_(a, b)
    else:
        torch.addmm(c, a, b, out_dtype=c.dtype, out=c)


@functools.cache
def _mixed_addmm_works(device: torch.device, in_dtype: torch.dtype, out_dtype: torch.dtype) -> bool:
    """Whether addmm_into accumulates `in_dtype` products in an `out_dtype` c on this device: CUDA only, and
    torch >= 2.10 for an fp32 c with bf16 inputs (pytorch#167931). Tried once, on 1 x 1 matrices, value checked."""
    c = torch.zeros(1, 1, device=device, dtype=out_dtype)
    one = torch.ones(1, 1, device=device, dtype=in_dtype)
    try:
        addmm_into(c, one, one)
    except (RuntimeError, TypeError):  # no such overload here (CPU raises NotImplementedError, a RuntimeError)
        return False
    return c.item() == 1.0


def _fusion_works(device: torch.device, dtype: torch.dtype, main_grad_dtype: torch.dtype) -> bool:
    """Whether the weight-gradient GEMM can accumulate `dtype` products in a `main_grad_dtype` main_grad here."""
    return main_grad_dtype == dtype or _mixed_addmm_works(device, dtype, main_grad_dtype)


def set_gradient_accumulation_fusion(module: torch.nn.Module, on: bool) -> None:
    """Every weight of `module` fuses its gradient into main_grad (on) or leaves it to DDP's add (off: Megatron's
    --no-gradient-accumulation-fusion); a weight that never had it set fuses."""
    for param in module.parameters():
        param.gradient_accumulation_fusion = on


def fuses_weight_grad(weight: torch.nn.Parameter) -> bool:
    """DDP marks the weights whose gradient it accumulates in main_grad with `grad_added_to_main_grad` (its promise
    to skip its own add while the flag is set); the fusion must be on for the weight and the GEMM able to
    accumulate in main_grad's dtype."""
    return (getattr(weight, "gradient_accumulation_fusion", True) and hasattr(weight, "grad_added_to_main_grad")
            and _fusion_works(weight.device, weight.dtype, weight.main_grad.dtype))


def accumulate_weight_grad(main_grad: torch.Tensor, grad_output: torch.Tensor, total_input: torch.Tensor) -> None:
    """main_grad += grad_output^T total_input ([out, rows] x [rows, inp]), as a backward leaves a DDP-owned weight's
    gradient: in the weight-gradient GEMM itself where fusion works, else that GEMM in the weight's dtype and DDP's
    hook's add. What the compute sweep times as a linear's `.wgrad` (EngineKernels.wgrad)."""
    if _fusion_works(main_grad.device, total_input.dtype, main_grad.dtype):
        addmm_into(main_grad, grad_output.t(), total_input)
    else:
        main_grad.add_(grad_output.t().matmul(total_input))


@dataclass(frozen=True)
class HeldOperands:
    """One backward's wgrad operands held for the flush ([rows, out], [rows, inp]); `rows`, where set, gives the
    [start, end) of both that are this weight's when first called (at the flush: module docstring)."""
    grad_output: torch.Tensor
    total_input: torch.Tensor
    rows: Callable[[], tuple[int, int]] | None = None

    def tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.rows is None:
            return self.grad_output, self.total_input
        start, end = self.rows()
        return self.grad_output[start:end], self.total_input[start:end]


def delay_weight_grad(weight: torch.nn.Parameter) -> None:
    """Hold `weight`'s weight-gradient operands in each backward, for flush_delayed_weight_grads (DDP must own its
    gradient: elsewhere its backward computes the gradient as usual)."""
    weight.delayed_wgrad = []


def _holds_weight_grad(weight: torch.nn.Parameter) -> bool:
    return getattr(weight, "delayed_wgrad", None) is not None and hasattr(weight, "grad_added_to_main_grad")


def holds_weight_grads(module: torch.nn.Module) -> bool:
    """Whether a delayed weight of `module` holds operands to flush."""
    return any(getattr(param, "delayed_wgrad", None) for param in module.parameters())


@torch.no_grad()
def flush_delayed_weight_grads(module: torch.nn.Module) -> None:
    """main_grad += (every held grad_output)^T (every held input) for each delayed weight of `module`, one GEMM a
    weight, the held operands dropped as it goes (so at most one weight's concatenation exists beside them)."""
    for param in module.parameters():
        held = getattr(param, "delayed_wgrad", None)
        if held:
            grads, inputs = zip(*(operands.tensors() for operands in held))
            held.clear()
            accumulate_weight_grad(param.main_grad, torch.cat(grads), torch.cat(inputs))


def drop_delayed_weight_grads(module: torch.nn.Module) -> None:
    """Forget the operands `module`'s delayed weights hold (a pass that must leave no gradient: the start-up pass
    timer)."""
    for param in module.parameters():
        if getattr(param, "delayed_wgrad", None):
            param.delayed_wgrad.clear()


def fused_weight_grad_placeholder(weight: torch.nn.Parameter) -> torch.Tensor:
    """After the wgrad GEMMs added dL/dW into main_grad: set DDP's flag and return what autograd gets as the weight's
    gradient (see _LinearWithGradAccumulation)."""
    weight.grad_added_to_main_grad = True
    return torch.zeros_like(weight) if getattr(weight, "zero_out_wgrad", False) else torch.empty_like(weight)


def weight_grad(param: torch.nn.Parameter, grad_output: torch.Tensor, total_input: torch.Tensor,
                rows: Callable[[], tuple[int, int]] | None = None) -> torch.Tensor:
    """What a linear's backward hands autograd for `param` from its wgrad GEMM's operands ([rows, out], [rows, inp];
    `rows`: the range of them that is this weight's, HeldOperands.rows): the operands held for the flush (a delayed
    weight) or dL/dW added into main_grad (fusion), each with DDP's placeholder, else the 16-bit dL/dW itself."""
    if _holds_weight_grad(param):
        param.delayed_wgrad.append(HeldOperands(grad_output, total_input, rows))
        return fused_weight_grad_placeholder(param)
    grad_output, total_input = HeldOperands(grad_output, total_input, rows).tensors()
    if fuses_weight_grad(param):
        accumulate_weight_grad(param.main_grad, grad_output, total_input)  # the fused GEMM, as the sweep times it
        return fused_weight_grad_placeholder(param)
    return grad_output.t().matmul(total_input)


def embedding_fuses_weight_grad(weight: torch.nn.Parameter) -> bool:
    """Whether the lookup adds its gradient into DDP's main_grad itself: whenever DDP owns the weight's gradient
    (index_put_ accumulates in any dtype). Its own switch is the embedding's (embedding_lookup's `fusion`), not the
    linears' gradient_accumulation_fusion."""
    return hasattr(weight, "grad_added_to_main_grad")


def accumulate_embedding_grad(main_grad: torch.Tensor, ids: torch.Tensor, grad_output: torch.Tensor) -> None:
    """main_grad[ids] += grad_output's rows, duplicates summed, in main_grad's dtype: the lookup's backward under
    the fusion, and what the compute sweep times as `embedding.bwd` with `into_main_grad`."""
    rows = grad_output.reshape(-1, grad_output.shape[-1]).to(main_grad.dtype)
    main_grad.index_put_((ids.reshape(-1),), rows, accumulate=True)


class _EmbeddingWithGradAccumulation(torch.autograd.Function):
    """F.embedding whose backward adds the rows' gradients into weight.main_grad and returns None for the weight: no
    dense gradient. DDP's hook still runs (autograd calls it with no gradient, or with a tied output layer's
    placeholder) and adds nothing the flag or a None says is already in main_grad."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids, weight)
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad_output):
        ids, weight = ctx.saved_tensors
        accumulate_embedding_grad(weight.main_grad, ids, grad_output)
        return None, None


def embedding_lookup(ids: torch.Tensor, weight: torch.nn.Parameter, fusion: bool = True) -> torch.Tensor:
    """The lookup, with its gradient fused into main_grad where `fusion` is on and DDP owns the gradient
    (embedding_fuses_weight_grad)."""
    if fusion and weight.requires_grad and embedding_fuses_weight_grad(weight):
        return _EmbeddingWithGradAccumulation.apply(ids, weight)
    return F.embedding(ids, weight)


class _LinearWithGradAccumulation(torch.autograd.Function):
    """y = x W^T, x all-gathered along the sequence first under sequence parallelism (see the module docstring).

    With fusion, backward adds dL/dW into weight.main_grad, sets weight.grad_added_to_main_grad and returns an
    uninitialised tensor of the weight's shape as its gradient: only so that autograd still runs DDP's
    post-accumulate-grad hook (bucket bookkeeping), which drops it and clears the flag. A weight that also feeds
    the embedding (tied, on a stage that holds both ends) needs nothing more while the lookup adds its own part into
    main_grad too; with the lookup's fusion off it carries Megatron's `zero_out_wgrad`: then the returned gradient is
    zeros, autograd adds the lookup's dense gradient to it, and DDP's hook adds that sum.
    """

    @staticmethod
    def forward(ctx, x, weight, tp, sequence_parallel):
        ctx.tp, ctx.sequence_parallel = tp, sequence_parallel
        # The Parameter itself, for its DDP attributes (main_grad, the fusion's flag, held operands): under full
        # recompute (non-reentrant checkpoint) the saved weight comes back as a detached alias without them.
        ctx.param = weight
        ctx.save_for_backward(x, weight)
        return F.linear(_all_gather(x, tp, 0, "sp all-gather") if sequence_parallel else x, weight)

    @staticmethod
    def backward(ctx, grad_output):
        x, weight = ctx.saved_tensors
        total_input = _all_gather(x, ctx.tp, 0, "sp all-gather (linear bwd)") if ctx.sequence_parallel else x
        grad_input = None
        if ctx.needs_input_grad[0]:
            grad_input = grad_output.matmul(weight)
            if ctx.sequence_parallel:
                grad_input = _reduce_scatter_dim0(grad_input, ctx.tp, "sp reduce-scatter (linear bwd)")
        grad_weight = None
        if ctx.needs_input_grad[1]:
            grad_weight = weight_grad(ctx.param, grad_output.reshape(-1, grad_output.shape[-1]),
                                      total_input.reshape(-1, total_input.shape[-1]))
        return grad_input, grad_weight, None, None


def _local_linear(x: torch.Tensor, weight: torch.Tensor, tp: TPGroup, sequence_parallel: bool,
                  fp8: Fp8Recipe | None) -> torch.Tensor:
    """The rank's GEMM of a parallel linear: torchao's float8 matmul under --fp8-format (never with sequence
    parallelism: check_fp8), else _LinearWithGradAccumulation."""
    if fp8 is not None:
        return fp8_matmul(fp8)(x, weight)
    return _LinearWithGradAccumulation.apply(x, weight, tp, sequence_parallel)


class ColumnParallelLinear(torch.nn.Module):
    """Y = X A^T with A split by output rows: weight [output_size/tp, input_size], partition_dim 0.

    Without sequence parallelism the input is replicated (copy_to: its gradient is all-reduced in backward); with
    it the input is sequence-sharded and all-gathered. gather_output all-gathers the output's last dim.
    `stride` > 1 keeps a fused weight [A; B; ...] correct under TP: each rank holds [A_r; B_r; ...].
    skip_weight_param_allocation (Megatron's): no weight of its own; forward takes one (a tied output layer
    multiplies by the embedding's weight, which has the same [output_size/tp, input_size] shard).
    """

    def __init__(self, input_size: int, output_size: int, *, tp: TPGroup, init: MasterWeightInit,
                 params_dtype: torch.dtype, device: torch.device | str, gather_output: bool = False,
                 sequence_parallel: bool = False, stride: int = 1, skip_weight_param_allocation: bool = False):
        super().__init__()
        if output_size % tp.size:
            raise ValueError(f"ColumnParallelLinear: output size {output_size} is not divisible by TP {tp.size}")
        if gather_output and sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output with sequence parallelism is not supported")
        self.input_size, self.output_size = input_size, output_size
        self.tp, self.gather_output = tp, gather_output
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.weight = None if skip_weight_param_allocation else _sharded_parameter(
            init, (output_size, input_size), 0, stride, tp, params_dtype, torch.device(device))
        self.fp8: Fp8Recipe | None = None  # set by engine/fp8_utils.convert_to_fp8

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """weight: the one to multiply by instead of self.weight (required without a weight of its own)."""
        if weight is None:
            if self.weight is None:
                raise ValueError("ColumnParallelLinear: built with skip_weight_param_allocation, forward needs weight")
            weight = self.weight
        if not self.sequence_parallel:
            x = copy_to_tensor_model_parallel_region(x, self.tp)
        out = _local_linear(x, weight, self.tp, self.sequence_parallel, self.fp8)
        return gather_from_tensor_model_parallel_region(out, self.tp) if self.gather_output else out


class RowParallelLinear(torch.nn.Module):
    """Y = sum_r X_r A_r^T with A split by input columns: weight [output_size, input_size/tp], partition_dim 1.

    The partial sums are all-reduced, or reduce-scattered along the sequence under sequence parallelism (which
    needs input_is_parallel: the input is the previous ColumnParallelLinear's sharded output).
    """

    def __init__(self, input_size: int, output_size: int, *, tp: TPGroup, init: MasterWeightInit,
                 params_dtype: torch.dtype, device: torch.device | str, input_is_parallel: bool = True,
                 sequence_parallel: bool = False):
        super().__init__()
        if input_size % tp.size:
            raise ValueError(f"RowParallelLinear: input size {input_size} is not divisible by TP {tp.size}")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence parallelism needs input_is_parallel=True")
        self.input_size, self.output_size = input_size, output_size
        self.tp, self.input_is_parallel = tp, input_is_parallel
        self.sequence_parallel = sequence_parallel and tp.size > 1
        self.weight = _sharded_parameter(init, (output_size, input_size), 1, 1, tp, params_dtype,
                                         torch.device(device))
        self.fp8: Fp8Recipe | None = None  # set by engine/fp8_utils.convert_to_fp8

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_tensor_model_parallel_region(x, self.tp)
        out = _local_linear(x, self.weight, self.tp, False, self.fp8)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.tp)
        return reduce_from_tensor_model_parallel_region(out, self.tp)


class VocabParallelEmbedding(torch.nn.Module):
    """Embedding split along the (padded) vocabulary: rank r holds rows [r V/tp, (r+1) V/tp).

    Takes token ids [b, s] and returns [s, b, h] (sequence first, ready for the decoder), or [s/tp, b, h] with
    reduce_scatter_embeddings (sequence parallelism). Each rank looks up the ids in its range, zeroes the rest, and
    the partial embeddings are summed across TP.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, tp: TPGroup, init: MasterWeightInit,
                 params_dtype: torch.dtype, device: torch.device | str, reduce_scatter_embeddings: bool = False):
        super().__init__()
        if num_embeddings % tp.size:
            raise ValueError(f"VocabParallelEmbedding: vocab {num_embeddings} is not divisible by TP {tp.size}; "
                             "pad it with pad_vocab_size")
        self.num_embeddings, self.embedding_dim, self.tp = num_embeddings, embedding_dim, tp
        per_partition = num_embeddings // tp.size
        self.vocab_start_index = tp.rank * per_partition
        self.vocab_end_index = self.vocab_start_index + per_partition
        self.reduce_scatter_embeddings = reduce_scatter_embeddings and tp.size > 1
        # the lookup's gradient added into main_grad by the lookup (engine's default; set from the run's config by
        # gpt_model.set_embedding_gradient_fusion)
        self.gradient_accumulation_fusion = True
        self.weight = _sharded_parameter(init, (num_embeddings, embedding_dim), 0, 1, tp, params_dtype,
                                         torch.device(device))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        ids = input_ids.t()  # [s, b]: the lookup then writes [s, b, h] directly, no transpose copy of the output
        if self.tp.size == 1:
            return embedding_lookup(ids, self.weight, self.gradient_accumulation_fusion)
        outside = (ids < self.vocab_start_index) | (ids >= self.vocab_end_index)
        local_ids = (ids - self.vocab_start_index).masked_fill_(outside, 0)
        out = embedding_lookup(local_ids, self.weight, self.gradient_accumulation_fusion)
        out = out.masked_fill_(outside.unsqueeze(-1), 0.0)
        if self.reduce_scatter_embeddings:
            return reduce_scatter_to_sequence_parallel_region(out, self.tp)
        return reduce_from_tensor_model_parallel_region(out, self.tp)
