"""Ring attention's CUDA block kernels (torch's flash attention ops with their log-sum-exp) against whole-sequence
attention, on one GPU: the C ranks of a ring run as threads exchanging in-process (tests.support.ring), so the
kernels, the online-softmax merge and the dK/dV partial sums run exactly as on C GPUs, without a process group.

    python runs/bench/ring_attention_cuda.py [--seq 8192] [--cp 2 4] [--json OUT]

The figure is each output's error against an fp32 reference (SDPA math kernel), beside the error of plain bf16 flash
attention (SDPA) on the whole sequence: the ring is right if its error is of the same size.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from engine.context_parallel import get_batch_on_this_cp_rank  # noqa: E402
from engine.transformer.ring_attention import flash_block_backward, flash_block_forward  # noqa: E402
from tests.support.ring import simulate_ring  # noqa: E402


def attention_and_grads(q, k, v, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def rel_error(a: torch.Tensor, ref: torch.Tensor) -> float:
    return float((a.float() - ref.float()).norm() / ref.float().norm())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    torch.manual_seed(0)
    shape = lambda h: (1, h, a.seq, a.head_dim)  # noqa: E731
    q, k, v = (torch.randn(shape(h), device="cuda", dtype=torch.bfloat16)
               for h in (a.heads, a.kv_heads, a.kv_heads))
    dout = torch.randn(shape(a.heads), device="cuda", dtype=torch.bfloat16)
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        reference = attention_and_grads(q.float(), k.float(), v.float(), dout.float())
    flash = attention_and_grads(q, k, v, dout)
    names = ("out", "dq", "dk", "dv")
    result = {"shape": {"seq": a.seq, "heads": a.heads, "kv_heads": a.kv_heads, "head_dim": a.head_dim},
              "sdpa_bf16": {n: rel_error(t, r) for n, t, r in zip(names, flash, reference)}}
    for cp in a.cp:
        ranks, _, _ = simulate_ring(q, k, v, dout, cp, flash_block_forward, flash_block_backward)
        errors = {}
        for i, n in enumerate(names):
            ring = torch.cat([ranks[r][i] for r in range(cp)], dim=2)
            expected = torch.cat([get_batch_on_this_cp_rank(reference[i], cp, r, dim=2) for r in range(cp)], dim=2)
            errors[n] = rel_error(ring, expected)
        result[f"ring_cp{cp}_flash_bf16"] = errors
    for key, errors in result.items():
        if key != "shape":
            print(f"{key:>22}: " + "  ".join(f"{n} {e:.2e}" for n, e in errors.items()))
    print("command: python " + " ".join(sys.argv))
    if a.json:
        a.json.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
