"""Core attention by SDPA backend on one GPU: torch's default pick (flash), cuDNN's fused attention and the
memory-efficient kernel, causal with GQA, on [b, heads, s, d] views of [s, b, heads, d] tensors as the engine calls
them (engine/transformer/attention.py): forward, and forward + backward, milliseconds and TFLOP/s (causal: 2 x 2 b s^2
heads d / 2 forward, 2.5x that backward). A backend that cannot run the call says why.

    python runs/bench/attention_backends.py [--iters 20] [--layouts]

Prints one JSON line per shape and backend, then 'BEST <shape> <backend>' for the fastest forward + backward.
--layouts: torch's pick instead, over the inputs' layout: the engine's views, q k v and the output's gradient each
contiguous [b, heads, s, d] ("bhsd"), q k v so and the gradient a view ("bhsd-qkv"), k and v alone so ("bhsd-kv"),
and K and V repeated to every head (no GQA in the kernel); each line also gives the output's strides.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# After three warm-up calls the first measurement of a freshly started device came out 15% slow (BENCHMARKS.md,
# 2026-12-03 "nineteenth"); ten.
WARMUP = 10
SHAPES = {"llama3.2-1b s4096": (4096, 32, 8, 64), "llama3.1-8b s8192": (8192, 32, 8, 128)}
BACKENDS = {"default": None, "flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}


def timed(fn, iters: int) -> float:
    for _ in range(WARMUP):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


# Which of q, k, v and the output's gradient each layout makes contiguous [b, heads, s, d] (the rest: views).
LAYOUTS = {"engine": "", "bhsd": "qkvg", "bhsd-qkv": "qkv", "bhsd-kv": "kv", "kv-repeated": ""}


def inputs(s: int, heads: int, kv: int, d: int, layout: str) -> tuple[torch.Tensor, ...]:
    """q, k, v [b, heads, s, d] and the output's gradient, in `layout` (module docstring)."""
    def tensor(name: str, n: int) -> torch.Tensor:
        grad = name != "g"
        if name in LAYOUTS[layout]:
            return torch.randn(1, n, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
        return torch.randn(s, 1, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=grad).permute(1, 2, 0, 3)

    return tensor("q", heads), tensor("k", kv), tensor("v", kv), tensor("g", heads)


def measure(shape: tuple[int, int, int, int], backend: SDPBackend | None, iters: int,
            layout: str = "engine") -> dict:
    s, heads, kv, d = shape
    q, k, v, grad = inputs(s, heads, kv, d, layout)
    repeat = heads // kv if layout == "kv-repeated" else 1

    def forward():
        with sdpa_kernel([backend] if backend is not None else list(BACKENDS_ALL)):
            kr, vr = (k.repeat_interleave(repeat, 1), v.repeat_interleave(repeat, 1)) if repeat > 1 else (k, v)
            return F.scaled_dot_product_attention(q, kr, vr, is_causal=True, enable_gqa=repeat == 1)

    def both():
        torch.autograd.backward(forward(), grad)

    flops = 2 * 2 * s * s * heads * d / 2
    with torch.no_grad():
        fwd = timed(forward, iters)
    step = timed(both, iters)
    with torch.no_grad():
        out_stride = forward().stride()
    return {"fwd_ms": fwd, "fwd_bwd_ms": step, "fwd_tflops": flops / fwd / 1e9,
            "fwd_bwd_tflops": 3.5 * flops / step / 1e9, "out_stride": out_stride}


BACKENDS_ALL = [b for b in BACKENDS.values() if b is not None]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--layouts", action="store_true", help="torch's pick over the inputs' layouts")
    a = ap.parse_args()
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    if a.layouts:
        for shape_name, shape in SHAPES.items():
            for layout in LAYOUTS:
                print(json.dumps({"shape": shape_name, "layout": layout, **measure(shape, None, a.iters, layout)}),
                      flush=True)
        return
    for shape_name, shape in SHAPES.items():
        results = {}
        for name, backend in BACKENDS.items():
            try:
                results[name] = measure(shape, backend, a.iters)
            except RuntimeError as e:
                results[name] = {"error": str(e).splitlines()[0][:300]}
            print(json.dumps({"shape": shape_name, "backend": name, **results[name]}), flush=True)
        ran = {n: r for n, r in results.items() if "fwd_bwd_ms" in r}
        print(f"BEST {shape_name} {min(ran, key=lambda n: ran[n]['fwd_bwd_ms'])}", flush=True)


if __name__ == "__main__":
    main()
