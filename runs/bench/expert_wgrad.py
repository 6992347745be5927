"""An expert's weight-gradient GEMMs over a step: one per micro-batch, or one over all micro-batches' rows.

    python runs/bench/expert_wgrad.py [--hidden 4096] [--ffn 14336] [--rows 1024] [--microbatches 8]

SequentialMLP adds each micro-batch's dL/dW = dY^T X into the fp32 main_grad in its own GEMM (beta = 1), with k = the
expert's rows in that micro-batch (~T k / E = 1,024 at mixtral-8x7b-2l's shape): each call reads and writes the whole
fp32 gradient for a short reduction. This times, for fc1 ([2f, h]) and fc2 ([h, f]), `--microbatches` such calls at
row counts near `--rows` against one call over their concatenated rows (the cat included), CUDA events, the median of
`--repeats`. Prints a table and the command. Needs CUDA.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.tensor_parallel.layers import addmm_into  # noqa: E402
from runs.bench.cp_ring_cuda import cuda_median  # noqa: E402


def compare(out: int, inp: int, counts: list[int], repeats: int) -> tuple[float, float]:
    """Seconds for the per-micro-batch GEMMs and for one GEMM over all rows, main_grad [out, inp] fp32."""
    main_grad = torch.zeros(out, inp, device="cuda", dtype=torch.float32)
    dys = [torch.randn(k, out, device="cuda", dtype=torch.bfloat16) for k in counts]
    xs = [torch.randn(k, inp, device="cuda", dtype=torch.bfloat16) for k in counts]

    def per_microbatch() -> None:
        for dy, x in zip(dys, xs):
            addmm_into(main_grad, dy.t(), x)

    def once() -> None:
        addmm_into(main_grad, torch.cat(dys).t(), torch.cat(xs))

    return cuda_median(per_microbatch, repeats, warmup=2), cuda_median(once, repeats, warmup=2)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--rows", type=int, default=1024)
    ap.add_argument("--microbatches", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("expert_wgrad.py: needs CUDA", file=sys.stderr)
        return 2
    gen = torch.Generator().manual_seed(0)
    counts = [int(a.rows + torch.randint(-200, 200, (1,), generator=gen)) // 16 * 16 for _ in range(a.microbatches)]
    print(f"rows per micro-batch {counts} (sum {sum(counts)})")
    print("| linear | main_grad | per micro-batch ms | TFLOP/s | once ms | TFLOP/s | saved ms |")
    print("|---|---|---|---|---|---|---|")
    for name, out, inp in (("fc1", 2 * a.ffn, a.hidden), ("fc2", a.hidden, a.ffn)):
        flops = 2.0 * out * inp * sum(counts)
        per, once = compare(out, inp, counts, a.repeats)
        print(f"| {name} | [{out}, {inp}] | {per * 1e3:.3f} | {flops / per / 1e12:.0f} | {once * 1e3:.3f} | "
              f"{flops / once / 1e12:.0f} | {(per - once) * 1e3:.3f} |")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("command: python3 runs/bench/expert_wgrad.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
