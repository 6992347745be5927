"""The host's cost of an expert GEMM at a row count cuBLAS has not seen: torch.mm's call time on the host (no sync)
for mixtral-8x7b's expert linears as SequentialMLP calls them (fc1 and fc2 forward, their input gradients; the
weights as the modules store them), at row counts M never used before in the process, then the same counts again,
then the counts rounded up to a multiple of --multiple once every such multiple was seen. Why: a profiled
mixtral-8x7b-2l step showed 19 expert mm calls of 4-7 ms on the host, each at a new, small row count (154-1088),
the GPU idle meanwhile (tests/fixtures/h200_moe/README.md, BENCHMARKS.md).

--warm N first meets N other new counts per GEMM (untimed), so the figures are a new count's cost once the process
has loaded the kernels the first few hundred counts pick (BENCHMARKS.md, 2026-12-05 sixth); --hidden / --ffn set
the widths (Mixtral's 4096 / 14336 by default; small ones ask whether a host sweep's small GEMM stands for them).

    python runs/bench/gemm_shape_host.py [--counts 32] [--multiple 64] [--warm 0] [--hidden 4096] [--ffn 14336]
                                         [--max-rows 1400]
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch


def host_us(a: torch.Tensor, b: torch.Tensor) -> float:
    start = time.perf_counter()
    torch.mm(a, b)
    return (time.perf_counter() - start) * 1e6


def rounded(m: int, multiple: int) -> int:
    return -(-m // multiple) * multiple


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--counts", type=int, default=32)
    ap.add_argument("--multiple", type=int, default=64)
    ap.add_argument("--warm", type=int, default=0, help="new counts met (untimed) before the timed ones")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--max-rows", type=int, default=1400, help="new counts lie in [64, this)")
    args = ap.parse_args(argv)
    rows = 4096
    if min(args.counts, args.multiple, args.hidden, args.ffn) < 1 or args.warm < 0 \
            or not args.counts + args.warm <= args.max_rows - 64 <= rows - 64:
        print(f"gemm_shape_host.py: --counts, --multiple, --hidden, --ffn must be at least 1, --warm at least 0, "
              f"--max-rows at most {rows}, and --counts + --warm at most --max-rows - 64 (the new counts lie in "
              f"[64, --max-rows))", file=sys.stderr)
        return 2
    dev, bf = torch.device("cuda"), torch.bfloat16
    h, f = args.hidden, args.ffn
    w1 = torch.randn(2 * f, h, device=dev, dtype=bf)  # linear_fc1.weight [2f, h]
    w2 = torch.randn(h, f, device=dev, dtype=bf)  # linear_fc2.weight [h, f]
    x, act = torch.randn(rows, h, device=dev, dtype=bf), torch.randn(rows, f, device=dev, dtype=bf)
    dy1 = torch.randn(rows, 2 * f, device=dev, dtype=bf)
    calls = {"fc1 fprop x W1^T": lambda m: (x[:m], w1.t()), "fc2 fprop a W2^T": lambda m: (act[:m], w2.t()),
             "fc1 dgrad dy W1": lambda m: (dy1[:m], w1), "fc2 dgrad dy W2": lambda m: (x[:m], w2)}
    drawn = random.Random(0).sample(range(64, args.max_rows), args.warm + args.counts)
    warm, counts = drawn[:args.warm], drawn[args.warm:]
    for name, operands in calls.items():
        torch.mm(*operands(rows))
        for m in warm:
            torch.mm(*operands(m))
        torch.cuda.synchronize()
        first = [host_us(*operands(m)) for m in counts]
        torch.cuda.synchronize()
        again = [host_us(*operands(m)) for m in counts]
        for m in range(args.multiple, rows + 1, args.multiple):  # every multiple seen once
            torch.mm(*operands(m))
        torch.cuda.synchronize()
        padded = [host_us(*operands(rounded(m, args.multiple))) for m in counts]
        torch.cuda.synchronize()
        slow = sorted(m for m, us in zip(counts, first) if us > 1000)
        print(f"{name}: host us per call over {len(counts)} counts in [64, {args.max_rows}) after {len(warm)} others, "
              f"median / max: new "
              f"{statistics.median(first):,.0f} / {max(first):,.0f} ({len(slow)} over 1 ms, at {slow}); seen again "
              f"{statistics.median(again):,.0f} / {max(again):,.0f}; rounded to {args.multiple} after warm-up "
              f"{statistics.median(padded):,.0f} / {max(padded):,.0f}", flush=True)
    print(f"torch {torch.__version__}, cuBLAS {torch.backends.cuda.preferred_blas_library()}")
    print(f"command: python runs/bench/gemm_shape_host.py --counts {args.counts} --multiple {args.multiple} "
          f"--warm {args.warm} --hidden {h} --ffn {f} --max-rows {args.max_rows}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
