"""The engine's training step with the grouped experts' GEMMs as torch's grouped GEMM (the engine's) or as one cuBLAS
mm per expert on the split read on the host: in backward only (the dgrad; the forward stays grouped and waits for
nothing), or in both passes (each layer's forward then waits for its counts). Weighs BENCHMARKS.md's microbenchmark
(2026-12-04 eighth entry: cuBLAS per expert 701-758 TFLOP/s against the grouped kernel's 595-698) in a whole step,
where the split costs host waits and cuBLAS's first call at each new row count.

    python3 -m torch.distributed.run --standalone --nproc-per-node 1 runs/bench/expert_gemm_step.py \\
        --variant grouped|cublas-dgrad|cublas-both ENGINE_TRAIN_FLAGS... (with --moe-grouped-gemm)
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine.train import main  # noqa: E402
from engine.transformer.moe import grouped_gemm_util as gg  # noqa: E402
from runs.bench.expert_activation import take_variant  # noqa: E402

VARIANTS = ("grouped", "cublas-dgrad", "cublas-both")
GROUPED, GROUPED_BACKWARD = gg.grouped_gemm, gg._GroupedLinear.backward
in_backward = [False]


def per_expert(x: torch.Tensor, weight: torch.Tensor, groups: gg.ExpertGroups) -> torch.Tensor:
    """grouped_gemm's product, one cuBLAS mm per expert into its rows of the output (rows past the groups zero)."""
    out = x.new_empty(x.shape[0], weight.shape[1])
    start = 0
    for e, count in enumerate(groups.host_counts.tolist()):
        torch.mm(x[start:start + count], weight[e].t(), out=out[start:start + count])
        start += count
    out[start:].zero_()
    return out


def backward(ctx, grad_output):
    in_backward[0] = True
    try:
        return GROUPED_BACKWARD(ctx, grad_output)
    finally:
        in_backward[0] = False


def swap(argv: list[str]) -> list[str]:
    """Set the experts' GEMMs from --variant (removed from argv); the rest is the engine's."""
    variant, rest = take_variant(argv, VARIANTS, "expert_gemm_step.py")
    if variant != "grouped":
        gg._GroupedLinear.backward = staticmethod(backward)
        gg.grouped_gemm = lambda x, weight, groups: (
            per_expert(x, weight, groups) if x.is_cuda and (variant == "cublas-both" or in_backward[0])
            else GROUPED(x, weight, groups))
    return rest


if __name__ == "__main__":
    sys.exit(main(swap(sys.argv[1:])))
