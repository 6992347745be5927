"""Start-up compute sweep: the model's own per-layer work, timed at the run's dtype and TP-local shapes on this device,
so the ledger's time model can predict a step without reading the step times it judges.

What is timed, one micro-batch at this rank's shapes (names and dims are the time model's,
ledger/models/time_model/ops.py; a test holds the two lists equal):
  GEMMs        linear_qkv, linear_proj, linear_fc1 (2f wide: SwiGLU's gate and up; f for GeLU), linear_fc2, and on
               the last stage output_layer: .fprop (x W^T), .dgrad (dY W), .wgrad (dY^T X accumulated into a grad-dtype
               main_grad in one GEMM where the device can, as the engine's gradient-accumulation fusion does, else a
               GEMM and an add)
  attention    core_attention.fwd / .bwd: F.scaled_dot_product_attention, causal, GQA, on [b, heads, s, d] views
               of [s, b, heads, d] tensors as the engine calls it. Under context parallelism (C > 1) every op of
               this list runs at the CP rank's L = s/C tokens, and core attention is ring attention's block kernels
               (EngineKernels.ring: the engine's own, flash on CUDA in 16 bits, the maths elsewhere) at the ring's
               two shapes, dims queries and causal beside seq (L: the keys): the causal diagonal block (L x L) and
               an unmasked half block (L/2 queries of the rank's second chunk against a whole L-key block), forward,
               and backward given that block's out and log-sum-exp; and ring_attention.merge.fwd / .bwd: the
               engine's ring loop on a ring of C without exchanges, its blocks answered by precomputed results, so
               the online-softmax merges and the dQ / dK-dV accumulations; the exchanges are the bandwidth sweep's
  elementwise  rms_norm.fwd / .bwd, residual_add, the attention output's [b, h, s, d] -> [s, b, h d] copy, and the
               engine's own fused functions (handed in as EngineKernels: compiled on GPU as the engine compiles
               them): rope (split_qkv_and_rotate) and swiglu forward / backward, and on the last stage
               cross_entropy forward / backward. A GPT-style shape (the ledger's formulas only: the engine runs
               none) has gelu forward / backward instead of swiglu, Megatron's bias_gelu as torch's tanh GeLU of
               the input plus a bias, layer_norm (F.layer_norm, weight and bias) instead of rms_norm, and no rope
               under learned positions
  MoE layer    (a model with experts, in place of the MLP's) router.fprop / .dgrad / .wgrad at the routed tokens,
               router.topk.fwd / .bwd (the engine's router after its GEMM: top-k, softmaxes, counts, the
               load-balancing loss and capacity drops where configured), moe.permute and moe.unpermute .fwd / .bwd
               (the engine's dispatcher at EP 1 on uniform routing: the rows sorted by expert and split per expert;
               the experts' outputs concatenated and combined per token), and the experts' linear_fc1 / swiglu /
               linear_fc2 at each of the rank's expert row counts (uniform routing: ExpertSpec), or under
               --moe-grouped-gemm experts.linear_fc1 / .linear_fc2 .fprop / .dgrad / .wgrad through the engine's
               grouped GEMM (MoEKernels.grouped_linear; fprop with the weights' stacking) and one swiglu over all
               the grouped rows; the all-to-alls are the bandwidth sweep's
  first stage  embedding.fwd / .bwd (the dense embedding gradient added into a main_grad, as DDP's hook does)
  per element  optimizer.step (grad norm, clip, fused AdamW, fp32 -> param copy) and grad_buffer.zero, at up to
               RATE_NUMEL_CAP elements; the time model scales them to the run's element counts
Each op: `warmup` calls, then `iters` timed ones, the median recorded; a backward's forward runs untimed before each
call. On GPU CUDA events bracket the op alone, after a device sleep long enough for the host to enqueue all of it:
so the figure is the device's time, as in a training step where the host runs ahead of the device (a run so small
that the host cannot keep up runs slower than predicted). On CPU perf_counter. Random inputs come from a private
generator, so the run's own random stream is untouched.

On GPU one more record, "sustained.layer": a layer's GEMMs (fprop, dgrad, wgrad), core_attention.fwd and forward
elementwise kernels back to back for SUSTAINED_WARMUP_S, then timed for SUSTAINED_TIMED_S (`seconds` per pass),
with the same kernels' isolated sums split into compute-bound (GEMM, attention: `compute_bound_s`) and memory-bound
(`memory_bound_s`): at its power limit the device slows the first, not the second, which the time model scales by.

Records (run-directory events of kind "compute"): op, dims, dtype, seconds, flops, iters, device, threads, variant,
cached. A cache under $XDG_CACHE_HOME/train-ledger/compute (default ~/.cache) keyed by device name, torch version,
dtypes, the planned ops with their dims, the engine's kernel variant and (CPU) the thread count lets a later run on
the same machine and shapes skip the measurement; `--no-compute-sweep-cache` measures anyway and refreshes it. The
cache is best effort: where it cannot be written (a read-only home) the run keeps its measurement and goes on.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from common.errors import InputError
from common.run_dir import atomic_write_text
from probes.bandwidth import to_dtype

RATE_NUMEL_CAP = 1 << 26
SWEEP_VERSION = 3  # bump when what a record measures changes: older cache entries are then not read
# GPU cycles (about 2 ms at 2 GHz) the device sleeps before each timed call, so that the host has enqueued the whole
# op before the start event fires: the events then time the device's work, not the host's launch overhead.
HOST_AHEAD_CYCLES = 4_000_000
# Under continuous load a GPU runs at its power limit, at lower clocks than the isolated timings above see (an H200:
# ~1.98 GHz alone, ~1.5-1.7 GHz at 690 W in training), which slows compute-bound kernels and not memory-bound ones.
# The sweep measures it on the model's own mix: one layer's directly callable kernels back to back.
SUSTAINED = "sustained.layer"
SUSTAINED_WARMUP_S, SUSTAINED_TIMED_S = 0.75, 1.0
SUSTAINED_KERNELS = tuple(f"{linear}.{gemm}" for linear in ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
                          for gemm in ("fprop", "dgrad", "wgrad")) + (
    "core_attention.fwd", "rms_norm.fwd", "residual_add", "attention_output.copy", "rope.fwd", "swiglu.fwd",
    "layer_norm.fwd", "gelu.fwd")


@dataclass(frozen=True)
class MoEKernels:
    """The engine's MoE layer pieces, as one rank runs them apart from the all-to-alls (its dispatcher at EP 1)."""
    route: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # logits [T, E] -> (experts, probs) [T, k]
    # (tokens [T, h], experts [T, k], probs [T, k] fp32, kept [T, k] bool) -> (rows by expert, rows per expert, plan)
    permute: Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, list[int], Any]]
    unpermute: Callable[[torch.Tensor, Any], torch.Tensor]  # (expert rows, plan) -> [T, h]
    swiglu: Callable[[torch.Tensor], torch.Tensor]  # the experts' (compiled for any row count)
    # --moe-grouped-gemm: (rows [N, k] grouped by expert, the experts' weights [n, k] each, counts [E] on the device)
    # -> [N, n], the weights stacked and multiplied as the engine's GroupedMLP does; None for SequentialMLP
    grouped_linear: Callable[[torch.Tensor, list[torch.Tensor], torch.Tensor], torch.Tensor] | None = None


@dataclass(frozen=True)
class RingKernels:
    """The engine's ring attention (engine/transformer/ring_attention.py) as the sweep times it, apart from its
    exchanges."""
    blocks: Callable[[torch.Tensor], tuple[Callable, Callable]]  # q -> (block forward, block backward) it runs
    forward: Callable[..., tuple[torch.Tensor, ...]]  # ring_forward(q, kv, cp, scale, attend)
    backward: Callable[..., tuple[torch.Tensor, ...]]  # ring_backward(dout, q, kv, out, lse, cp, scale, attend_bwd)
    group: Callable[[int], Any]  # C -> a ring of C (rank 0) with no process group: the loops then exchange nothing


@dataclass(frozen=True)
class EngineKernels:
    """The engine's own functions for the work it fuses, so the sweep times what runs; `variant` says how they run
    (compiled or eager) and keys the cache; `moe` for a model with experts."""
    split_qkv_and_rotate: Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    swiglu: Callable[[torch.Tensor], torch.Tensor]
    cross_entropy: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (logits [s, b, v], target [s, b])
    variant: str
    moe: MoEKernels | None = None
    ring: RingKernels | None = None  # needed under context parallelism


@dataclass(frozen=True)
class SweepSpec:
    """One rank's shapes: seq = s / C (the CP rank's tokens), widths TP-local, the vocab padded and split;
    norm_tokens = seq b / t under SP."""
    dtype: str
    grad_dtype: str
    seq: int
    micro_batch: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    norm_tokens: int
    first_stage: bool
    last_stage: bool
    optimizer_numel: int
    grad_buffer_numel: int
    swiglu: bool = True  # else the GPT style's GeLU MLP: fc1 f wide
    rope: bool = True  # else learned absolute positions
    layer_norm: bool = False  # else RMSNorm
    moe: "ExpertSpec | None" = None  # the MLP is an MoE layer
    cp: int = 1  # C > 1: core attention is ring attention's blocks

    @classmethod
    def from_run(cls, run_config: Any, *, tp_size: int, padded_vocab_size: int, first_stage: bool,
                 last_stage: bool, optimizer_numel: int, grad_buffer_numel: int) -> "SweepSpec":
        m, t, cp = run_config.model, run_config.train, run_config.parallel.context_parallel_size
        sb = m.seq_length // cp * t.micro_batch_size
        return cls(dtype=t.params_dtype, grad_dtype=t.grad_dtype, seq=m.seq_length // cp,
                   micro_batch=t.micro_batch_size,
                   hidden=m.hidden_size, heads=m.num_attention_heads // tp_size,
                   kv_heads=m.num_query_groups // tp_size, head_dim=m.hidden_size // m.num_attention_heads,
                   ffn=m.ffn_hidden_size // tp_size, vocab=padded_vocab_size // tp_size,
                   norm_tokens=sb // (tp_size if run_config.parallel.sequence_parallel and tp_size > 1 else 1),
                   first_stage=first_stage, last_stage=last_stage, optimizer_numel=optimizer_numel,
                   grad_buffer_numel=grad_buffer_numel, swiglu=m.swiglu,
                   rope=m.position_embedding_type == "rope", layer_norm=m.normalization == "LayerNorm",
                   moe=ExpertSpec.from_run(run_config, tp_size) if m.num_experts is not None else None, cp=cp)

    @property
    def fc1(self) -> int:
        return 2 * self.ffn if self.swiglu else self.ffn

    @property
    def tokens(self) -> int:
        return self.seq * self.micro_batch


@dataclass(frozen=True)
class ExpertSpec:
    """A rank's MoE layer under uniform routing: its T routed tokens (s/C b, / t under SP) each pick k of E experts;
    an expert keeps at most ceil(T k / E x c) of them under a capacity factor c; the kept ones (`routed`) are split
    as evenly as they go over the rank's E / EP experts (every EP rank routing alike, a rank receives what it
    sends)."""
    experts: int
    topk: int
    tokens: int
    capacity: int | None
    local_experts: int
    ffn: int  # f_moe / t
    aux_loss: bool
    grouped: bool = False  # --moe-grouped-gemm

    @classmethod
    def from_run(cls, run_config: Any, tp_size: int) -> "ExpertSpec":
        m, p = run_config.model, run_config.parallel
        tokens = (m.seq_length // p.context_parallel_size * run_config.train.micro_batch_size
                  // (tp_size if p.sequence_parallel else 1))
        cf = m.moe_expert_capacity_factor
        return cls(experts=m.num_experts, topk=m.moe_router_topk, tokens=tokens,
                   capacity=math.ceil(tokens * m.moe_router_topk / m.num_experts * cf) if cf is not None else None,
                   local_experts=m.num_experts // p.expert_model_parallel_size,
                   ffn=m.expert_ffn_hidden_size // tp_size, aux_loss=m.moe_aux_loss_coeff > 0,
                   grouped=m.moe_grouped_gemm)

    @property
    def grouped_rows(self) -> int:
        """A grouped GEMM's rows: at EP 1 every assignment (the engine keeps the counts on the device and carries
        the dropped rows), under EP > 1 the kept ones."""
        return self.tokens * self.topk if self.local_experts == self.experts else self.routed

    @property
    def counts(self) -> list[int]:
        """Each local expert's kept rows under uniform routing, as evenly as they split."""
        each, extra = divmod(self.routed, self.local_experts)
        return [each + (i < extra) for i in range(self.local_experts)]

    @property
    def routed(self) -> int:
        assignments = self.tokens * self.topk
        return assignments if self.capacity is None else min(assignments, self.experts * self.capacity)

    @property
    def rows(self) -> list[int]:
        """The distinct row counts of the rank's experts (one or two), none empty."""
        each, extra = divmod(self.routed, self.local_experts)
        return sorted({r for r in (each, each + 1 if extra else each) if r > 0})

    @property
    def copy_dims(self) -> dict[str, int]:
        return dict(tokens=self.tokens, topk=self.topk, rows=self.routed)


class _Op:
    """A timed call: `setup` runs untimed before each `run` (a backward's forward)."""

    def setup(self) -> None:
        pass

    def run(self) -> None:
        raise NotImplementedError


class _Call(_Op):
    def __init__(self, fn: Callable[[], Any]):
        self.fn = fn

    def run(self) -> None:
        self.fn()


class _Backward(_Op):
    """The gradients of `inputs` from `forward()`'s outputs and fixed output gradients, through torch.autograd.grad
    (nothing accumulates into .grad between calls); `after` gets them and is timed too (DDP's main_grad add)."""

    def __init__(self, forward: Callable[[], Any], inputs: tuple[torch.Tensor, ...],
                 grads: tuple[torch.Tensor, ...], after: Callable[[tuple[torch.Tensor, ...]], None] | None = None):
        self.forward, self.inputs, self.grads, self.after = forward, inputs, grads, after
        self.outputs: tuple[torch.Tensor, ...] = ()

    def setup(self) -> None:
        outputs = self.forward()
        self.outputs = outputs if isinstance(outputs, tuple) else (outputs,)

    def run(self) -> None:
        grads = torch.autograd.grad(self.outputs, self.inputs, self.grads)
        self.outputs = ()
        if self.after is not None:
            self.after(grads)


@dataclass(frozen=True)
class Planned:
    op: str
    dims: dict[str, int]
    dtype: str
    flops: float
    build: Callable[[], _Op]


class _Tensors:
    """Random tensors of one device and dtype from a private generator."""

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.gen = torch.Generator(device=device).manual_seed(0)

    def randn(self, *shape: int, dtype: torch.dtype | None = None, grad: bool = False) -> torch.Tensor:
        t = torch.randn(*shape, generator=self.gen, device=self.device, dtype=dtype or self.dtype)
        return t.requires_grad_(grad)

    def ids(self, high: int, *shape: int) -> torch.Tensor:
        return torch.randint(0, high, shape, generator=self.gen, device=self.device)


def _accumulator(device: torch.device, dtype: torch.dtype, grad_dtype: torch.dtype) -> Callable:
    """main_grad += a @ b as the engine's fused weight-gradient GEMM does (beta 1, output in main_grad's dtype),
    else a GEMM and an add where this device has no such GEMM (CPU with 16-bit inputs)."""
    def fused(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        if c.dtype == a.dtype:
            c.addmm_(a, b)
        else:
            torch.addmm(c, a, b, out_dtype=c.dtype, out=c)

    def unfused(c: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
        c.add_(a.matmul(b))

    one = torch.ones(1, 1, device=device, dtype=dtype)
    c = torch.zeros(1, 1, device=device, dtype=grad_dtype)
    try:
        fused(c, one, one)
    except (RuntimeError, TypeError):
        return unfused
    return fused if c.item() == 1.0 else unfused


def _gemms(spec: SweepSpec, t: _Tensors, grad_dtype: torch.dtype, accumulate: Callable) -> list[Planned]:
    """Each linear's three GEMMs at its row count: the layer's tokens, an MoE layer's router at its routed tokens and
    its experts' fc1 / fc2 at each of their row counts (in place of the dense MLP's)."""
    h, f, x = spec.hidden, spec.ffn, spec.moe
    linears = [("linear_qkv", (spec.heads + 2 * spec.kv_heads) * spec.head_dim, h, spec.tokens),
               ("linear_proj", h, spec.heads * spec.head_dim, spec.tokens)]
    if x is None:
        linears += [("linear_fc1", spec.fc1, h, spec.tokens), ("linear_fc2", h, f, spec.tokens)]
    else:
        linears.append(("router", x.experts, h, x.tokens))
        for rows in x.rows if not x.grouped else []:  # grouped GEMMs: _grouped_gemms
            linears += [("linear_fc1", 2 * x.ffn, h, rows), ("linear_fc2", h, x.ffn, rows)]
    if spec.last_stage:
        linears.append(("output_layer", spec.vocab, h, spec.tokens))
    out = []
    for name, n_out, n_in, tokens in linears:
        def fprop(n_out=n_out, n_in=n_in, tokens=tokens) -> _Op:
            x, w = t.randn(tokens, n_in), t.randn(n_out, n_in)
            return _Call(lambda: F.linear(x, w))

        def dgrad(n_out=n_out, n_in=n_in, tokens=tokens) -> _Op:
            g, w = t.randn(tokens, n_out), t.randn(n_out, n_in)
            return _Call(lambda: g.matmul(w))

        def wgrad(n_out=n_out, n_in=n_in, tokens=tokens) -> _Op:
            g, x = t.randn(tokens, n_out), t.randn(tokens, n_in)
            c = torch.zeros(n_out, n_in, device=t.device, dtype=grad_dtype)
            return _Call(lambda: accumulate(c, g.t(), x))

        flops = 2.0 * tokens * n_out * n_in
        out += [Planned(f"{name}.fprop", dict(m=tokens, n=n_out, k=n_in), spec.dtype, flops, fprop),
                Planned(f"{name}.dgrad", dict(m=tokens, n=n_in, k=n_out), spec.dtype, flops, dgrad),
                Planned(f"{name}.wgrad", dict(m=n_out, n=n_in, k=tokens), spec.dtype, flops, wgrad)]
    return out


def _attention(spec: SweepSpec, t: _Tensors) -> list[Planned]:
    s, b, heads, kv, d = spec.seq, spec.micro_batch, spec.heads, spec.kv_heads, spec.head_dim
    gqa = heads > kv

    def leaves(grad: bool) -> tuple[torch.Tensor, ...]:
        return tuple(t.randn(s, b, n, d, grad=grad) for n in (heads, kv, kv))

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        q, k, v = (x.permute(1, 2, 0, 3) for x in (q, k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)

    def forward() -> _Op:
        q, k, v = leaves(False)
        return _Call(lambda: attend(q, k, v))

    def backward() -> _Op:
        q, k, v = leaves(True)
        grad = t.randn(s, b, heads, d).permute(1, 2, 0, 3)  # as linear_proj's input grad arrives, viewed back
        return _Backward(lambda: attend(q, k, v), (q, k, v), (grad,))

    dims = dict(batch=b, heads=heads, kv_heads=kv, seq=s, head_dim=d)
    flops = 2.0 * b * heads * s * s * d
    return [Planned("core_attention.fwd", dims, spec.dtype, flops, forward),
            Planned("core_attention.bwd", dims, spec.dtype, 2.5 * flops, backward)]


def _ring(spec: SweepSpec, t: _Tensors, ring: RingKernels) -> list[Planned]:
    """Ring attention on L = s/C local tokens as ring_forward / ring_backward run it: its two block kernels (q a
    [b, heads, L, d] view of [L, b, heads, d], its second half's rows for the half block; K and V of the stacked
    [2, b, kv_heads, L, d] block; the backward given the block's out in the compute dtype and its lse), and the
    engine's ring loop itself on a ring of C without exchanges, as CP rank 0 runs it, its block kernels answered by
    precomputed results: what is left is the online-softmax merges (forward) and the dQ / dK-dV accumulations
    (backward)."""
    length, b, heads, kv, d = spec.seq, spec.micro_batch, spec.heads, spec.kv_heads, spec.head_dim
    scale, half = 1.0 / math.sqrt(d), slice(length // 2, None)

    def rows(causal: bool) -> slice:
        return slice(None) if causal else half

    def operands() -> tuple[torch.Tensor, torch.Tensor]:
        q = t.randn(length, b, heads, d).permute(1, 2, 0, 3)
        return q, torch.stack([t.randn(length, b, kv, d).permute(1, 2, 0, 3) for _ in range(2)])

    def block(causal: bool, backward: bool) -> _Op:
        q, kv_block = operands()
        q, k, v = q[:, :, rows(causal)], kv_block[0], kv_block[1]
        forward, backward_fn = ring.blocks(q)
        if not backward:
            return _Call(lambda: forward(q, k, v, causal, scale))
        out, lse = forward(q, k, v, causal, scale)
        out = out.to(t.dtype)
        dout = t.randn(b, heads, length, d)[:, :, :q.shape[2]]
        return _Call(lambda: backward_fn(dout, q, k, v, out, lse, causal, scale))

    def merges(backward: bool) -> _Op:
        q, kv_block = operands()
        forward, backward_fn = ring.blocks(q)
        cp = ring.group(spec.cp)
        if not backward:
            done = {c: forward(q[:, :, rows(c)], kv_block[0], kv_block[1], c, scale) for c in (True, False)}
            return _Call(lambda: ring.forward(q, kv_block, cp, scale, lambda *args: done[args[3]]))
        out, lse, _ = ring.forward(q, kv_block, cp, scale, forward)
        out, dout = out.to(t.dtype), t.randn(b, heads, length, d)
        done = {c: backward_fn(dout[:, :, rows(c)], q[:, :, rows(c)], kv_block[0], kv_block[1], out[:, :, rows(c)],
                               lse[:, :, rows(c)], c, scale) for c in (True, False)}
        return _Call(lambda: ring.backward(dout, q, kv_block, out, lse, cp, scale, lambda *args: done[args[6]]))

    flops = 2.0 * b * heads * length * length * d  # L^2/2 query-key pairs either block, 4 d FLOPs each
    out = []
    for causal in (True, False):
        dims = dict(batch=b, heads=heads, kv_heads=kv, seq=length, queries=length if causal else length // 2,
                    causal=int(causal), head_dim=d)
        out += [Planned("core_attention.fwd", dims, spec.dtype, flops, lambda c=causal: block(c, False)),
                Planned("core_attention.bwd", dims, spec.dtype, 2.5 * flops, lambda c=causal: block(c, True))]
    merged = dict(batch=b, heads=heads, kv_heads=kv, seq=length, head_dim=d, cp=spec.cp)
    return out + [Planned(f"ring_attention.merge.{p}", merged, spec.dtype, 0.0, lambda bwd=p == "bwd": merges(bwd))
                  for p in ("fwd", "bwd")]


def _elementwise(spec: SweepSpec, t: _Tensors, kernels: EngineKernels) -> list[Planned]:
    s, b, h, d = spec.seq, spec.micro_batch, spec.hidden, spec.head_dim
    groups, width, fc1 = spec.kv_heads, spec.heads // spec.kv_heads + 2, spec.fc1
    norm = dict(tokens=spec.norm_tokens, hidden=h)
    rope = dict(seq=s, batch=b, groups=groups, width=width, head_dim=d)

    def normalize(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.layer_norm(x, (h,), w, bias, 1e-5) if bias is not None else F.rms_norm(x, (h,), w, 1e-5)

    def norm_forward() -> _Op:
        x, w = t.randn(spec.norm_tokens, h), t.randn(h)
        bias = t.randn(h) if spec.layer_norm else None
        return _Call(lambda: normalize(x, w, bias))

    def norm_backward() -> _Op:
        x, w, g = t.randn(spec.norm_tokens, h, grad=True), t.randn(h, grad=True), t.randn(spec.norm_tokens, h)
        bias = t.randn(h, grad=True) if spec.layer_norm else None
        weights = (w,) if bias is None else (w, bias)
        return _Backward(lambda: normalize(x, w, bias), (x, *weights), (g,))

    norm_op = "layer_norm" if spec.layer_norm else "rms_norm"

    def add() -> _Op:
        x, y = t.randn(spec.norm_tokens * h), t.randn(spec.norm_tokens * h)
        return _Call(lambda: torch.add(x, y))

    def copy() -> _Op:
        x = t.randn(b, spec.heads, s, d)
        return _Call(lambda: x.permute(2, 0, 1, 3).reshape(s, b, -1))

    def rotary(backward: bool) -> _Op:
        qkv, cos, sin = t.randn(s, b, groups, width, d, grad=backward), t.randn(s, 1, 1, d), t.randn(s, 1, 1, d)
        if not backward:
            return _Call(lambda: kernels.split_qkv_and_rotate(qkv, cos, sin))
        grads = (t.randn(s, b, groups * (width - 2), d), t.randn(s, b, groups, d), t.randn(s, b, groups, d))
        return _Backward(lambda: kernels.split_qkv_and_rotate(qkv, cos, sin), (qkv,), grads)

    def gated(backward: bool) -> _Op:
        x = t.randn(s, b, fc1, grad=backward)
        if not backward:
            return _Call(lambda: kernels.swiglu(x))
        g = t.randn(s, b, fc1 // 2)
        return _Backward(lambda: kernels.swiglu(x), (x,), (g,))

    def bias_gelu(backward: bool) -> _Op:
        x, bias = t.randn(s, b, fc1, grad=backward), t.randn(fc1, grad=backward)
        if not backward:
            return _Call(lambda: F.gelu(x + bias, approximate="tanh"))
        return _Backward(lambda: F.gelu(x + bias, approximate="tanh"), (x, bias), (t.randn(s, b, fc1),))

    activation, act = ("swiglu", gated) if spec.swiglu else ("gelu", bias_gelu)
    rotary_ops = [Planned("rope.fwd", rope, spec.dtype, 0.0, lambda: rotary(False)),
                  Planned("rope.bwd", rope, spec.dtype, 0.0, lambda: rotary(True))] if spec.rope else []
    mlp = [Planned(f"{activation}.{p}", dict(tokens=spec.tokens, width=fc1), spec.dtype, 0.0,
                   lambda backward=p == "bwd": act(backward)) for p in ("fwd", "bwd")] if spec.moe is None else []
    return [Planned(f"{norm_op}.fwd", norm, spec.dtype, 0.0, norm_forward),
            Planned(f"{norm_op}.bwd", norm, spec.dtype, 0.0, norm_backward),
            Planned("residual_add", dict(numel=spec.norm_tokens * h), spec.dtype, 0.0, add),
            Planned("attention_output.copy", dict(numel=spec.tokens * spec.heads * d), spec.dtype, 0.0, copy),
            *rotary_ops, *mlp]


def _uniform_routing(x: ExpertSpec, t: _Tensors, grad: bool) -> tuple[torch.Tensor, ...]:
    """experts [T, k] spreading the T k assignments evenly (assignment i to expert i mod E: k distinct experts a
    token), probs [T, k] fp32, kept [T, k] (an expert keeps its first `capacity`)."""
    slots = torch.arange(x.tokens * x.topk, device=t.device)
    experts = (slots % x.experts).view(x.tokens, x.topk)
    kept = slots // x.experts < (x.capacity if x.capacity is not None else x.tokens * x.topk)
    return experts, t.randn(x.tokens, x.topk, dtype=torch.float32, grad=grad), kept.view(x.tokens, x.topk)


def _grouped_gemms(spec: SweepSpec, t: _Tensors, kernels: MoEKernels) -> list[Planned]:
    """--moe-grouped-gemm: each expert linear's fprop (stacking the weights, as the engine does per forward), dgrad
    and wgrad through the engine's grouped GEMM, over the grouped rows split as uniform routing splits them."""
    if kernels.grouped_linear is None:
        raise ValueError("a sweep of grouped expert GEMMs needs the engine's (MoEKernels.grouped_linear)")
    x, h = spec.moe, spec.hidden
    return (_grouped_linear(spec, t, kernels, "linear_fc1", 2 * x.ffn, h)
            + _grouped_linear(spec, t, kernels, "linear_fc2", h, x.ffn))


def _grouped_linear(spec: SweepSpec, t: _Tensors, kernels: MoEKernels, name: str, n_out: int,
                    n_in: int) -> list[Planned]:
    x, rows = spec.moe, spec.moe.grouped_rows
    counts = torch.tensor(x.counts, device=t.device)

    def operands(grad: bool) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return t.randn(rows, n_in, grad=grad), [t.randn(n_out, n_in, grad=grad) for _ in range(x.local_experts)]

    def fprop() -> _Op:
        a, weights = operands(False)
        return _Call(lambda: kernels.grouped_linear(a, weights, counts))

    def backward(wgrad: bool) -> _Op:
        a, weights = operands(True)
        return _Backward(lambda: kernels.grouped_linear(a, weights, counts), tuple(weights) if wgrad else (a,),
                         (t.randn(rows, n_out),))

    flops, dims = 2.0 * rows * n_out * n_in, dict(experts=x.local_experts)
    return [Planned(f"experts.{name}.fprop", dict(dims, m=rows, n=n_out, k=n_in), spec.dtype, flops, fprop),
            Planned(f"experts.{name}.dgrad", dict(dims, m=rows, n=n_in, k=n_out), spec.dtype, flops,
                    lambda: backward(False)),
            Planned(f"experts.{name}.wgrad", dict(dims, m=n_out, n=n_in, k=rows), spec.dtype, flops,
                    lambda: backward(True))]


def _moe(spec: SweepSpec, t: _Tensors, kernels: MoEKernels) -> list[Planned]:
    """An MoE layer's ops beside its GEMMs: the router's top-k, permute and unpermute through the engine's own
    functions at uniform routing, and the experts' SwiGLU at each row count."""
    x, h = spec.moe, spec.hidden

    def route(backward: bool) -> _Op:
        logits = t.randn(x.tokens, x.experts, grad=backward)
        if not backward:
            return _Call(lambda: kernels.route(logits))
        return _Backward(lambda: kernels.route(logits)[1], (logits,),
                         (t.randn(x.tokens, x.topk, dtype=torch.float32),))

    def permuted(backward: bool) -> tuple[Callable[[], tuple[torch.Tensor, ...]], torch.Tensor]:
        """The dispatch as the experts see it: the permuted rows split per expert (their backward: a cat)."""
        tokens = t.randn(x.tokens, h, grad=backward)
        experts, probs, kept = _uniform_routing(x, t, grad=False)

        def forward() -> tuple[torch.Tensor, ...]:
            rows, per_expert, _ = kernels.permute(tokens, experts, probs, kept)
            return rows.split(per_expert)
        return forward, tokens

    def permute(backward: bool) -> _Op:
        forward, tokens = permuted(backward)
        if not backward:
            return _Call(forward)
        grads = tuple(t.randn(*c.shape) for c in forward())
        return _Backward(forward, (tokens,), grads)

    def unpermute(backward: bool) -> _Op:
        """The experts' outputs concatenated (SequentialMLP) and combined per token."""
        tokens = t.randn(x.tokens, h)
        experts, probs, kept = _uniform_routing(x, t, grad=backward)
        _, per_expert, plan = kernels.permute(tokens, experts, probs, kept)
        outputs = tuple(t.randn(n, h, grad=backward) for n in per_expert)
        if not backward:
            return _Call(lambda: kernels.unpermute(torch.cat(outputs), plan))
        return _Backward(lambda: kernels.unpermute(torch.cat(outputs), plan), (*outputs, probs),
                         (t.randn(x.tokens, h),))

    def gated(rows: int, backward: bool) -> _Op:
        y = t.randn(rows, 2 * x.ffn, grad=backward)
        if not backward:
            return _Call(lambda: kernels.swiglu(y))
        return _Backward(lambda: kernels.swiglu(y), (y,), (t.randn(rows, x.ffn),))

    topk = dict(tokens=x.tokens, experts=x.experts, topk=x.topk, aux_loss=int(x.aux_loss),
                dropping=int(x.capacity is not None))
    out = []
    for p in ("fwd", "bwd"):
        backward = p == "bwd"
        out += [Planned(f"router.topk.{p}", topk, spec.dtype, 0.0, lambda b=backward: route(b)),
                Planned(f"moe.permute.{p}", {**x.copy_dims, "hidden": h}, spec.dtype, 0.0,
                        lambda b=backward: permute(b)),
                Planned(f"moe.unpermute.{p}", {**x.copy_dims, "hidden": h}, spec.dtype, 0.0,
                        lambda b=backward: unpermute(b))]
        out += [Planned(f"swiglu.{p}", dict(tokens=rows, width=2 * x.ffn), spec.dtype, 0.0,
                        lambda rows=rows, b=backward: gated(rows, b))
                for rows in ([x.grouped_rows] if x.grouped else x.rows)]
    return out + (_grouped_gemms(spec, t, kernels) if x.grouped else [])


def _ends(spec: SweepSpec, t: _Tensors, kernels: EngineKernels, grad_dtype: torch.dtype) -> list[Planned]:
    s, b, v, h = spec.seq, spec.micro_batch, spec.vocab, spec.hidden
    out = []
    if spec.first_stage:
        dims = dict(tokens=spec.tokens, vocab=v, hidden=h)

        def lookup() -> _Op:
            ids, w = t.ids(v, s, b), t.randn(v, h)
            return _Call(lambda: F.embedding(ids, w))

        def lookup_backward() -> _Op:
            ids, w, g = t.ids(v, s, b), t.randn(v, h, grad=True), t.randn(s, b, h)
            main_grad = torch.zeros(v, h, device=t.device, dtype=grad_dtype)
            return _Backward(lambda: F.embedding(ids, w), (w,), (g,), lambda grads: main_grad.add_(grads[0]))

        out += [Planned("embedding.fwd", dims, spec.dtype, 0.0, lookup),
                Planned("embedding.bwd", dims, spec.dtype, 0.0, lookup_backward)]
    if spec.last_stage:
        dims = dict(tokens=spec.tokens, vocab=v)

        def loss(backward: bool) -> _Op:
            logits, target = t.randn(s, b, v, grad=backward), t.ids(v, s, b)
            if not backward:
                return _Call(lambda: kernels.cross_entropy(logits, target))
            g = t.randn(s, b, dtype=torch.float32)
            return _Backward(lambda: kernels.cross_entropy(logits, target), (logits,), (g,))

        out += [Planned("cross_entropy.fwd", dims, spec.dtype, 0.0, lambda: loss(False)),
                Planned("cross_entropy.bwd", dims, spec.dtype, 0.0, lambda: loss(True))]
    return out


def _rates(spec: SweepSpec, t: _Tensors, dtype: torch.dtype, grad_dtype: torch.dtype) -> list[Planned]:
    def step() -> _Op:
        n = min(spec.optimizer_numel, RATE_NUMEL_CAP)
        main = t.randn(n, dtype=torch.float32)
        model = main if dtype == torch.float32 else main.to(dtype)
        grads = t.randn(n, dtype=grad_dtype)
        main.grad = grads if grad_dtype == torch.float32 else torch.empty_like(main)
        fused = {"fused": True} if t.device.type == "cuda" else {"foreach": True}
        optimizer = torch.optim.AdamW([main], lr=1e-4, weight_decay=0.01, **fused)

        @torch.no_grad()
        def update() -> None:
            if main.grad is not grads:
                main.grad.copy_(grads)
            norm = torch.stack(torch._foreach_norm([main.grad])).square().sum().sqrt()
            torch._foreach_mul_([main.grad], (1.0 / (norm + 1e-6)).clamp(max=1.0))
            optimizer.step()
            if model is not main:
                model.copy_(main)
        return _Call(update)

    def zero() -> _Op:
        buffer = torch.empty(min(spec.grad_buffer_numel, RATE_NUMEL_CAP), device=t.device, dtype=grad_dtype)
        return _Call(buffer.zero_)

    return [Planned("optimizer.step", dict(numel=min(spec.optimizer_numel, RATE_NUMEL_CAP)), spec.dtype, 0.0, step),
            Planned("grad_buffer.zero", dict(numel=min(spec.grad_buffer_numel, RATE_NUMEL_CAP)), spec.grad_dtype,
                    0.0, zero)]


def plan(spec: SweepSpec, device: torch.device, kernels: EngineKernels) -> list[Planned]:
    """Every op this rank's stage runs, with its dims and a builder of its timed call."""
    dtype, grad_dtype = to_dtype(spec.dtype), to_dtype(spec.grad_dtype)
    t = _Tensors(device, dtype)
    accumulate = _accumulator(device, dtype, grad_dtype)
    if spec.moe is not None and kernels.moe is None:
        raise ValueError("an MoE model's sweep needs the engine's MoE kernels (EngineKernels.moe)")
    if spec.cp > 1 and kernels.ring is None:
        raise ValueError("a context-parallel sweep needs the engine's ring attention (EngineKernels.ring)")
    moe = _moe(spec, t, kernels.moe) if spec.moe is not None else []
    attention = _attention(spec, t) if spec.cp == 1 else _ring(spec, t, kernels.ring)
    return (_gemms(spec, t, grad_dtype, accumulate) + attention + _elementwise(spec, t, kernels) + moe
            + _ends(spec, t, kernels, grad_dtype) + _rates(spec, t, dtype, grad_dtype))


def median_seconds(op: _Op, warmup: int, iters: int, cuda: bool) -> float:
    for _ in range(warmup):
        op.setup()
        op.run()
    marks = []
    for _ in range(iters):
        op.setup()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(HOST_AHEAD_CYCLES)
            start.record()
            op.run()
            end.record()
            marks.append((start, end))
        else:
            t0 = time.perf_counter()
            op.run()
            marks.append(time.perf_counter() - t0)
    if cuda:
        torch.cuda.synchronize()
        return statistics.median(start.elapsed_time(end) / 1e3 for start, end in marks)
    return statistics.median(marks)


def _back_to_back(one_pass: Callable[[], None], seconds: float) -> int:
    """Enqueue passes for `seconds` of host time, the host kept at most two blocks of ten ahead of the device (an
    event per block) so that the device never idles and the queue stays short; returns the passes enqueued."""
    passes, previous = 0, None
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        for _ in range(10):
            one_pass()
        passes += 10
        mark = torch.cuda.Event()
        mark.record()
        if previous is not None:
            previous.synchronize()
        previous = mark
    return passes


def sustained_layer(planned: list[Planned], isolated: list[float]) -> dict[str, Any]:
    """A layer's directly callable kernels (no autograd setup between them; an MoE layer's experts once per row
    count) back to back on the GPU until it sits at its power limit, then timed: seconds per pass, beside the same
    kernels' isolated sums by kind (`isolated`: each planned op's seconds, in order)."""
    chosen = [(p, seconds) for p, seconds in zip(planned, isolated) if p.op in SUSTAINED_KERNELS]
    layer = [p for p, _ in chosen]
    ops = [p.build() for p in layer]

    def one_pass() -> None:
        for op in ops:
            op.run()

    _back_to_back(one_pass, SUSTAINED_WARMUP_S)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    passes = _back_to_back(one_pass, SUSTAINED_TIMED_S)
    end.record()
    end.synchronize()
    compute = sum(seconds for p, seconds in chosen if p.flops > 0)
    return {"op": SUSTAINED, "dims": {"kernels": len(layer)}, "dtype": layer[0].dtype,
            "seconds": start.elapsed_time(end) / 1e3 / passes, "flops": sum(p.flops for p in layer),
            "compute_bound_s": compute, "memory_bound_s": sum(seconds for _, seconds in chosen) - compute,
            "iters": passes}


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "train-ledger" / "compute"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu {platform.processor() or platform.machine()}"


def cache_key(planned: list[Planned], device: torch.device, kernels: EngineKernels) -> dict[str, Any]:
    return {"version": SWEEP_VERSION, "device": device_name(device), "torch": torch.__version__,
            "variant": kernels.variant, "threads": torch.get_num_threads() if device.type == "cpu" else None,
            "ops": [[p.op, p.dims, p.dtype] for p in planned]}


def _cache_file(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / f"{digest}.json"


def _cached(key: dict[str, Any]) -> list[dict[str, Any]] | None:
    path = _cache_file(key)
    try:
        entry = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return entry["records"] if isinstance(entry, dict) and entry.get("key") == key else None


def _store(key: dict[str, Any], records: list[dict[str, Any]]) -> None:
    """Write the cache entry; one that cannot be written costs a later run a measurement, never this run."""
    try:
        atomic_write_text(_cache_file(key), json.dumps({"key": key, "records": records}, sort_keys=True) + "\n")
    except (InputError, OSError):
        pass


def run(spec: SweepSpec, device: torch.device, kernels: EngineKernels, *, use_cache: bool = True,
        warmup: int | None = None, iters: int | None = None) -> list[dict[str, Any]]:
    """This rank's `compute` records: from the cache when it holds this machine and shape (and use_cache), else
    measured now and written to the cache."""
    cuda = device.type == "cuda"
    warmup = warmup if warmup is not None else (3 if cuda else 1)
    iters = iters if iters is not None else (10 if cuda else 3)
    planned = plan(spec, device, kernels)
    key = cache_key(planned, device, kernels)
    found = _cached(key) if use_cache else None
    if found is not None:
        return [{**r, "cached": True} for r in found]
    records = [{"op": p.op, "dims": p.dims, "dtype": p.dtype, "seconds": median_seconds(p.build(), warmup, iters, cuda),
                "flops": p.flops, "iters": iters} for p in planned]
    if cuda:
        records.append(sustained_layer(planned, [r["seconds"] for r in records]))
    records = [{**r, "device": key["device"], "threads": torch.get_num_threads(), "variant": kernels.variant}
               for r in records]
    if cuda:
        torch.cuda.empty_cache()  # the sweep's buffers leave no reserved memory behind
    _store(key, records)
    return [{**r, "cached": False} for r in records]
