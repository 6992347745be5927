"""Ring attention over the context-parallel group, as Transformer Engine's AttnFuncWithCPAndKVP2P (Megatron's
--cp-comm-type p2p): causal attention of this rank's s/C queries against the whole sequence's keys, with the K/V
blocks passed around the ring instead of gathered.

Why a ring: gathering every rank's K/V would hold the whole sequence's K and V on every rank, the memory CP exists to
cut; in a ring a rank holds two blocks at a time (the one it computes on and the one arriving), and each transfer runs
beside a block's attention, so it costs time only when it is slower than that block.

The details: docs/engine.md, "The ring".
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from probes.probe_set import NullProbeSet
from probes.protocol import ProbeSetProtocol

FLASH_DTYPES = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class CPGroup:
    """The context-parallel group as ring attention needs it: handle, size, this rank's index, its ring neighbours
    (global ranks) and the probes."""
    group: Any
    size: int
    rank: int
    next_rank: int | None
    prev_rank: int | None
    probes: ProbeSetProtocol = NullProbeSet()

    @classmethod
    def from_parallel_state(cls, parallel_state: Any, probes: ProbeSetProtocol | None = None) -> "CPGroup":
        """No group or neighbours for a layout-only state (checkpoint resharding builds models on the meta device,
        which never run a forward)."""
        ranks, r = parallel_state.ranks.get("cp"), parallel_state.cp_rank
        return cls(group=parallel_state.groups.get("cp"), size=parallel_state.cp_size, rank=r,
                   next_rank=ranks[(r + 1) % len(ranks)] if ranks else None,
                   prev_rank=ranks[(r - 1) % len(ranks)] if ranks else None,
                   probes=probes if probes is not None else NullProbeSet())


class _Exchange:
    """One batched isend/irecv on the ring, in flight: `send` to dst, a buffer of its shape from src."""

    def __init__(self, cp: CPGroup, send: torch.Tensor, dst: int, src: int, name: str, **attrs: Any):
        self.cp, self.name = cp, name
        self.received = torch.empty_like(send)
        nbytes = 2 * send.numel() * send.element_size()
        self.requests, self.token = cp.probes.comm_issue(
            name, "cp-comm", lambda: dist.batch_isend_irecv([dist.P2POp(dist.isend, send, dst, cp.group),
                                                             dist.P2POp(dist.irecv, self.received, src, cp.group)]),
            bytes=nbytes, dst_rank=dst, src_rank=src, **attrs)

    def wait(self) -> torch.Tensor:
        with self.cp.probes.range(f"wait {self.name}", "cp-wait"):
            for request in self.requests:
                request.wait()
        self.cp.probes.comm_end(self.token)
        return self.received


# --- block kernels: (out, lse) = attention of q against k, v; its gradients given the final out and lse -----------
def _acc(t: torch.Tensor) -> torch.Tensor:
    """t in the accumulation dtype: fp32, or wider when t is (fp64 in tests)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _repeat_kv(t: torch.Tensor, heads_per_group: int) -> torch.Tensor:
    return t if heads_per_group == 1 else t.repeat_interleave(heads_per_group, dim=1)


def _sum_kv(t: torch.Tensor, heads_per_group: int) -> torch.Tensor:
    if heads_per_group == 1:
        return t
    b, h, s, d = t.shape
    return t.view(b, h // heads_per_group, heads_per_group, s, d).sum(dim=2)


def _math_scores(q: torch.Tensor, k: torch.Tensor, causal: bool, scale: float) -> torch.Tensor:
    scores = torch.matmul(_acc(q), _acc(k).transpose(-1, -2)) * scale
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return scores


def math_block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                       scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [b, hq, sq, d], lse [b, hq, sq], both fp32 or wider); k, v [b, hkv, sk, d]."""
    g = q.shape[1] // k.shape[1]
    scores = _math_scores(q, _repeat_kv(k, g), causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), _acc(_repeat_kv(v, g))), lse


def math_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    """(dq, dk, dv) in fp32 (or wider) of this block, given the whole attention's out and lse over these queries."""
    g = q.shape[1] // k.shape[1]
    k_, v_, dout = _acc(_repeat_kv(k, g)), _acc(_repeat_kv(v, g)), _acc(dout)
    probs = torch.exp(_math_scores(q, k_, causal, scale) - lse.unsqueeze(-1))
    dv = torch.matmul(probs.transpose(-1, -2), dout)
    dscores = probs * (torch.matmul(dout, v_.transpose(-1, -2)) - (dout * _acc(out)).sum(-1, keepdim=True))
    dq = torch.matmul(dscores, k_) * scale
    dk = torch.matmul(dscores.transpose(-1, -2), _acc(q)) * scale
    return dq, _sum_kv(dk, g), _sum_kv(dv, g)


def flash_block_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool,
                        scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    g = q.shape[1] // k.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention(
        q, _repeat_kv(k, g), _repeat_kv(v, g), 0.0, causal, False, scale=scale)[:2]
    return out, lse


def flash_block_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         lse: torch.Tensor, causal: bool, scale: float) -> tuple[torch.Tensor, ...]:
    g = q.shape[1] // k.shape[1]
    # No dropout: the rng state is never read, but the op takes one (empty, as its forward returns without dropout).
    seed, offset = (torch.empty((), dtype=torch.long, device=q.device) for _ in range(2))
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.contiguous(), q, _repeat_kv(k, g), _repeat_kv(v, g), out.contiguous(), lse.contiguous(), None, None,
        q.shape[2], k.shape[2], 0.0, causal, seed, offset, scale=scale)
    return dq, _sum_kv(dk, g), _sum_kv(dv, g)


def block_kernels(q: torch.Tensor) -> tuple[Callable, Callable]:
    if q.is_cuda and q.dtype in FLASH_DTYPES:
        return flash_block_forward, flash_block_backward
    return math_block_forward, math_block_backward


# --- which part of a block each ring step computes (module docstring) -----------------------------------------------
def block_rows_and_keys(src: int, rank: int, local_len: int) -> tuple[slice, slice, bool]:
    """(query rows, key rows of the source block, causal) of step with the K/V block of CP rank src."""
    half = local_len // 2
    if src == rank:
        return slice(None), slice(None), True
    if src < rank:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


# --- forward / backward ---------------------------------------------------------------------------------------------
def ring_forward(q: torch.Tensor, kv: torch.Tensor, cp: CPGroup, scale: float, attend: Callable,
                 exchange: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out fp32, lse fp32, the last K/V block held) for q [b, hq, s/C, d] and this rank's kv [2, b, hkv, s/C, d].
    `exchange(kv, step)` passes the held block on and returns the in-flight exchange (None: a ring of one)."""
    out = lse = None
    for step in range(cp.size):
        src = (cp.rank - step) % cp.size
        flight = exchange(kv, step) if exchange is not None and step < cp.size - 1 else None
        rows, keys, causal = block_rows_and_keys(src, cp.rank, q.shape[2])
        block_out, block_lse = attend(q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys], causal, scale)
        if out is None:
            out, lse = _acc(block_out), block_lse
        else:
            merged = torch.logaddexp(lse[:, :, rows], block_lse)
            out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - merged).unsqueeze(-1)
                               + _acc(block_out) * torch.exp(block_lse - merged).unsqueeze(-1))
            lse[:, :, rows] = merged
        if flight is not None:
            kv = flight.wait()
    return out, lse, kv


def ring_backward(dout: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, out: torch.Tensor, lse: torch.Tensor,
                  cp: CPGroup, scale: float, attend_backward: Callable,
                  exchange: Callable | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq, dkv of this rank's own block) given the forward's last block kv (rank i + 1's). `exchange(message,
    step)` sends the message to the previous rank and returns the in-flight exchange of the next rank's."""
    C, i, n = cp.size, cp.rank, kv.shape[0]
    dq = torch.zeros_like(_acc(q))
    dkv_sent = None  # the previous block's complete-through-this-rank dK/dV
    for step in range(C):
        src = (i + 1 + step) % C
        flight = None
        if exchange is not None and C > 1:
            message = kv if step == 0 else dkv_sent if step == C - 1 else torch.cat((kv, dkv_sent))
            flight = exchange(message, step)
        rows, keys, causal = block_rows_and_keys(src, i, q.shape[2])
        dq_b, dk_b, dv_b = attend_backward(dout[:, :, rows], q[:, :, rows], kv[0][:, :, keys], kv[1][:, :, keys],
                                           out[:, :, rows], lse[:, :, rows], causal, scale)
        dq[:, :, rows] += dq_b
        dkv = torch.zeros_like(_acc(kv))
        dkv[0][:, :, keys] = dk_b
        dkv[1][:, :, keys] = dv_b
        if flight is not None:
            received = flight.wait()
            if step > 0:  # the partial sum of this block from the ranks before this one
                dkv += received[-n:]
            if step < C - 1:
                kv = received[:n]
        dkv_sent = dkv.to(kv.dtype)
    return dq, dkv


class RingAttention(torch.autograd.Function):
    """softmax(q k^T / sqrt(d), causal over the whole sequence) v for this CP rank's queries (module docstring)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPGroup) -> torch.Tensor:
        scale = 1.0 / math.sqrt(q.shape[-1])
        attend, attend_backward = block_kernels(q)
        out, lse, last_kv = ring_forward(
            q, torch.stack((k, v)), cp, scale, attend,
            lambda kv, step: _Exchange(cp, kv, cp.next_rank, cp.prev_rank, f"cp sendrecv kv forward step{step}",
                                       phase="forward", ring_step=step))
        out = out.to(q.dtype)
        ctx.save_for_backward(q, last_kv, out, lse)
        ctx.cp, ctx.scale, ctx.attend_backward = cp, scale, attend_backward
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        q, kv, out, lse = ctx.saved_tensors
        cp = ctx.cp
        dq, dkv = ring_backward(
            dout.contiguous(), q, kv, out, lse, cp, ctx.scale, ctx.attend_backward,
            lambda message, step: _Exchange(cp, message, cp.prev_rank, cp.next_rank,
                                            f"cp sendrecv kv_dkv backward step{step}", phase="backward",
                                            ring_step=step))
        return dq.to(q.dtype), dkv[0].to(q.dtype), dkv[1].to(q.dtype), None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPGroup) -> torch.Tensor:
    """q [b, hq, s/C, d], k and v [b, hkv, s/C, d] of this CP rank's chunks; returns [b, hq, s/C, d]."""
    return RingAttention.apply(q, k, v, cp)
