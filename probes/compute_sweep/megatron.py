"""Megatron-LM's unfused chains (common/ops/megatron.py), each timed as Megatron-LM's local implementation runs it:
the same torch ops in the same order, on tensors of the entry's dims (Megatron-LM itself is not imported; its code at
the pinned commit is what these restate, docs/formulas.md "Megatron-LM's kernels"):

  core_attention.softmax    masked_fill_ of the [b, 1, s, s] mask on a view of baddbmm's scores, softmax (fp32: on
                            the scores' fp32 copy, then back to 16 bits); backward through autograd, so AsStrided and
                            CopySlices run as they do in a step
  attention.repeat_kv       repeat_interleave of K and V to every head (backward: the sums over the repeats)
  rope_unfused              q's reshape copy out of the fused QKV, then _apply_rotary_pos_emb_bshd on q and on k
  swiglu_unfused            chunk, silu, the up half + 0.0 (glu_linear_offset), the product
  cross_entropy_fp32        vocab_parallel_cross_entropy's forward (the fp32 copy, max, sub, exp, sum, div in place)
                            and its backward (the target's subtraction, the scale in place, the cast to 16 bits)
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from probes.compute_sweep.calls import Backward, Bench, Builder, Call, Op


class Fresh(Op):
    """A call on a fresh copy of `source` each time (untimed), for an op that works in place on what it is given."""

    def __init__(self, source: torch.Tensor, fn):
        self.source, self.fn, self.work = source, fn, source

    def setup(self) -> None:
        self.work = self.source.clone()

    def run(self) -> None:
        self.fn(self.work)


def builders(b: Bench) -> dict[str, Builder]:
    t, sh = b.tensors, b.shapes
    s, batch, heads, d = sh.seq, sh.micro_batch, sh.heads, sh.head_dim

    def masked_softmax(scores: torch.Tensor, mask: torch.Tensor, fp32: bool) -> torch.Tensor:
        view = scores.view(batch, heads, s, s)
        if fp32:
            x = view.float()
            x.masked_fill_(mask, -10000.0)
            return torch.softmax(x, -1).to(t.dtype)
        view.masked_fill_(mask, -10000.0)
        return torch.softmax(view, -1)

    def softmax(backward: bool) -> Builder:
        def build(dims: dict[str, int]) -> Op:
            fp32 = bool(dims["fp32"])
            mask = torch.ones(batch, 1, s, s, dtype=torch.bool, device=t.device).triu_(1)
            scores = t.randn(batch * heads, s, s, grad=backward)
            if not backward:
                return Call(lambda: masked_softmax(scores, mask, fp32))
            grad = t.randn(batch, heads, s, s)
            return Backward(lambda: masked_softmax(scores.clone(), mask, fp32), (scores,), (grad,))
        return build

    def repeat(backward: bool) -> Builder:
        def build(dims: dict[str, int]) -> Op:
            groups, times = dims["kv"] // d, dims["query"] // dims["kv"]
            k, v = (t.randn(s, batch, groups, d, grad=backward) for _ in range(2))

            def both() -> tuple[torch.Tensor, torch.Tensor]:
                return k.repeat_interleave(times, dim=2), v.repeat_interleave(times, dim=2)
            if not backward:
                return Call(both)
            grads = tuple(t.randn(s, batch, groups * times, d) for _ in range(2))
            return Backward(both, (k, v), grads)
        return build

    def rope(backward: bool) -> Builder:
        def build(dims: dict[str, int]) -> Op:
            groups, per_group = dims["kv"] // d, dims["query"] // dims["kv"]
            qkv = t.randn(s, batch, groups, (per_group + 2) * d, grad=backward)
            freqs = t.randn(s, 1, 1, d, dtype=torch.float32)

            def rotate(x: torch.Tensor) -> torch.Tensor:
                cos, sin = torch.cos(freqs).to(x.dtype), torch.sin(freqs).to(x.dtype)
                x1, x2 = torch.chunk(x, 2, dim=-1)
                rotated = x * cos + torch.cat((-x2, x1), dim=-1) * sin
                return torch.cat((rotated, x[..., d:]), dim=-1)

            def both() -> tuple[torch.Tensor, torch.Tensor]:
                q = qkv[..., :per_group * d].reshape(s, batch, groups * per_group, d)
                return rotate(q), rotate(qkv[..., per_group * d:(per_group + 1) * d])
            if not backward:
                return Call(both)
            grads = (t.randn(s, batch, groups * per_group, d), t.randn(s, batch, groups, d))
            return Backward(both, (qkv,), grads)
        return build

    def swiglu(backward: bool) -> Builder:
        def build(dims: dict[str, int]) -> Op:
            x = t.randn(dims["tokens"], dims["width"], grad=backward)

            def glu() -> torch.Tensor:
                gate, up = torch.chunk(x, 2, dim=-1)
                return F.silu(gate) * (up + 0.0)
            if not backward:
                return Call(glu)
            return Backward(glu, (x,), (t.randn(dims["tokens"], dims["width"] // 2),))
        return build

    def cross_entropy(backward: bool) -> Builder:
        def build(dims: dict[str, int]) -> Op:
            rows, vocab = dims["tokens"], dims["vocab"]
            logits, target = t.randn(rows, vocab), t.ids(vocab, rows)
            arange = torch.arange(rows, device=t.device)

            def forward() -> torch.Tensor:
                x = logits.float()
                x -= torch.max(x, dim=-1)[0].unsqueeze(-1)
                torch.exp(x, out=x)
                return x.div_(x.sum(dim=-1).unsqueeze(-1))
            if not backward:
                return Call(forward)
            scale = t.randn(rows, dtype=torch.float32)

            def grad(softmax: torch.Tensor) -> None:
                softmax[arange, target] -= 1.0
                softmax.mul_(scale.unsqueeze(-1)).to(t.dtype)
            return Fresh(forward(), grad)
        return build

    return {"core_attention.softmax.fwd": softmax(False), "core_attention.softmax.bwd": softmax(True),
            "attention.repeat_kv.fwd": repeat(False), "attention.repeat_kv.bwd": repeat(True),
            "rope_unfused.fwd": rope(False), "rope_unfused.bwd": rope(True),
            "swiglu_unfused.fwd": swiglu(False), "swiglu_unfused.bwd": swiglu(True),
            "cross_entropy_fp32.fwd": cross_entropy(False), "cross_entropy_fp32.bwd": cross_entropy(True)}
