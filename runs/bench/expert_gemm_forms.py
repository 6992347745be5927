"""An MoE layer's expert GEMMs, four ways, at mixtral-8x7b-2l's shape: is torch's grouped GEMM the ceiling?

    python runs/bench/expert_gemm_forms.py [--iters 20] [--spread 30]

8 experts, 8,192 rows (4,096 tokens x top-2) split among them as a routing does (1,024 +- --spread rows each, fixed
seed), hidden 4,096, each expert's fc1 [28,672, 4,096] and fc2 [4,096, 14,336]; bf16. For fc1's forward, fc2's
forward and fc1's dgrad: torch._grouped_mm over the groups (the engine's --moe-grouped-gemm, offsets on the device),
one cuBLAS mm per expert on its rows (the split known on the host), torch.bmm over the experts padded to the largest
group, and one dense mm over all rows with one expert's weight (the GEMM ceiling at this size, not a result).
CUDA events around --iters calls after warm-up, median ms and TFLOP/s of the useful FLOPs. Needs CUDA.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from runs.bench.cp_ring_cuda import cuda_median  # noqa: E402

EXPERTS, TOKENS, TOPK, H, F = 8, 4096, 2, 4096, 14336


def counts(spread: int) -> list[int]:
    gen = torch.Generator().manual_seed(0)
    noise = torch.randint(-spread, spread + 1, (EXPERTS - 1,), generator=gen).tolist()
    first = [TOKENS * TOPK // EXPERTS + n for n in noise]
    return [*first, TOKENS * TOPK - sum(first)]


def forms(x: torch.Tensor, w: torch.Tensor, split: list[int]) -> dict[str, object]:
    """y_e = x_e w_e^T for each expert's rows x_e, w [E, n, k]."""
    offsets = torch.tensor(split, device=x.device).cumsum(0).to(torch.int32)
    largest = max(split)
    padded = torch.zeros(EXPERTS, largest, x.shape[1], device=x.device, dtype=x.dtype)
    for e, rows in enumerate(x.split(split)):
        padded[e, :rows.shape[0]] = rows
    wt = w.transpose(1, 2)
    return {
        "torch._grouped_mm": lambda: torch._grouped_mm(x, wt, offs=offsets),
        "cuBLAS per expert": lambda: [torch.mm(rows, w[e].t()) for e, rows in enumerate(x.split(split))],
        "bmm padded to the largest": lambda: torch.bmm(padded, wt),
        "dense mm (ceiling)": lambda: torch.mm(x, w[0].t()),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--spread", type=int, default=30)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("expert_gemm_forms.py: needs CUDA", file=sys.stderr)
        return 2
    split = counts(a.spread)
    rows = sum(split)
    dev, bf16 = "cuda", torch.bfloat16
    cases = {"fc1 forward": (torch.randn(rows, H, device=dev, dtype=bf16), torch.randn(EXPERTS, 2 * F, H, device=dev,
                                                                                          dtype=bf16)),
             "fc2 forward": (torch.randn(rows, F, device=dev, dtype=bf16), torch.randn(EXPERTS, H, F, device=dev,
                                                                                      dtype=bf16)),
             # the engine's dgrad multiplies by fc1's weights [E, 2F, H] as they lie: w is their transposed view
             "fc1 dgrad": (torch.randn(rows, 2 * F, device=dev, dtype=bf16),
                           torch.randn(EXPERTS, 2 * F, H, device=dev, dtype=bf16).transpose(1, 2))}
    print(f"rows per expert: {split}")
    print("| GEMM | form | ms | TFLOP/s |")
    print("|---|---|---|---|")
    for name, (x, w) in cases.items():
        flops = 2 * rows * w.shape[1] * w.shape[2]
        for form, fn in forms(x, w, split).items():
            t = cuda_median(fn, a.iters, warmup=3)
            print(f"| {name} | {form} | {t * 1e3:.3f} | {flops / t / 1e12:.0f} |", flush=True)
    print("command: python3 runs/bench/expert_gemm_forms.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
