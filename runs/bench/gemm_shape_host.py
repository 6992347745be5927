"""The host's cost of a GEMM whose shape cuBLAS has not seen: torch.mm's call time on the host (no sync) for the
MoE experts' three GEMMs (mixtral-8x7b's fc1 fprop, fc2 fprop, fc1 wgrad) at row counts M never used before in the
process, then the same counts again, then counts rounded up to a multiple of --multiple once every such count was
seen. Why: a profiled mixtral-8x7b-2l step showed 19 expert mm calls of 4-7 ms on the host, each at a new row count,
the GPU idle meanwhile (BENCHMARKS.md).

    python runs/bench/gemm_shape_host.py [--counts 24] [--multiple 64]
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch


def host_us(a: torch.Tensor, b: torch.Tensor) -> float:
    start = time.perf_counter()
    torch.mm(a, b)
    return (time.perf_counter() - start) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", type=int, default=24)
    ap.add_argument("--multiple", type=int, default=64)
    args = ap.parse_args()
    dev, bf = torch.device("cuda"), torch.bfloat16
    h, f = 4096, 14336
    shapes = {"fc1 fprop [M,h]x[h,2f]": (h, 2 * f, False), "fc2 fprop [M,f]x[f,h]": (f, h, False),
              "fc1 wgrad [2f,M]x[M,h]": (h, 2 * f, True)}
    rng = random.Random(0)
    counts = rng.sample(range(100, 3000), args.counts)
    for name, (k, n, wgrad) in shapes.items():
        x = torch.randn(4096, k, device=dev, dtype=bf)
        w = torch.randn(k, n, device=dev, dtype=bf)
        gy = torch.randn(4096, n, device=dev, dtype=bf)

        def operands(m: int) -> tuple[torch.Tensor, torch.Tensor]:
            """fprop: x[M, k] @ w[k, n]; wgrad: gy[M, n]^T @ x[M, k], as a linear's backward calls it."""
            return (gy[:m].t(), x[:m]) if wgrad else (x[:m], w)
        torch.mm(*operands(64))
        torch.cuda.synchronize()
        first = [host_us(*operands(m)) for m in counts]
        torch.cuda.synchronize()
        again = [host_us(*operands(m)) for m in counts]
        torch.cuda.synchronize()
        padded = sorted({-(-m // args.multiple) * args.multiple for m in range(1, 3001)})
        for m in padded:  # every multiple seen once
            torch.mm(*operands(m))
        torch.cuda.synchronize()
        rounded = [host_us(*operands(-(-m // args.multiple) * args.multiple)) for m in counts]
        torch.cuda.synchronize()
        print(f"{name}: host us per call, median (max) over {len(counts)} counts: new count "
              f"{statistics.median(first):,.0f} ({max(first):,.0f}); seen {statistics.median(again):,.0f}; "
              f"rounded to {args.multiple} after warm-up {statistics.median(rounded):,.0f} ({max(rounded):,.0f})",
              flush=True)
    print(f"torch {torch.__version__}, cuBLAS {torch.backends.cuda.preferred_blas_library()}")
    print("command: python runs/bench/gemm_shape_host.py "
          f"--counts {args.counts} --multiple {args.multiple}")


if __name__ == "__main__":
    main()
