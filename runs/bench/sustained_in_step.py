"""How much slower a run's compute-bound kernels ran inside its profiled step than the sweep timed them alone, beside
the slowdown the time model applies (the sweep's sustained.layer factor, probes/compute_sweep/sustained.py).

For each run directory with a compute sweep and a profiler trace (one GPU, one stage): the time model's GEMMs and
core attention for the step (every such kernel of the stage's forward and backward passes, times the micro-batches)
at their isolated sweep seconds, against the trace's GEMM and attention kernels in its first profiled step (by
kernel name: cuBLAS's nvjet / gemm kernels, cuDNN's and flash attention's). No device needed: committed fixtures.

    python runs/bench/sustained_in_step.py [RUN ...]
"""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.ops import Kernel  # noqa: E402
from ledger.evidence.exec_graph import read_graph  # noqa: E402
from ledger.evidence.run import collect_run  # noqa: E402
from ledger.models.time_model.calibration import Calibration  # noqa: E402
from ledger.models.time_model.ops import chunk_backward, chunk_forward  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[2] / "tests" / "fixtures"
RUNS = ["h200_llama1b/s4096_profiled", "h200_moe/mixtral-8x7b-2l_fused", "h200_moe/mixtral-8x7b-2l_profiled",
        "h200_2layer_profiled", "gpu_h200_llama1b_l2", "h200_launch_bound/lb_h1024_l4_s512"]
COMPUTE_KERNELS = ("nvjet", "gemm", "cutlass", "sdpa", "fmha", "flash", "cudnn")


def isolated_seconds(run: Path) -> tuple[float, float]:
    """(the stage's compute-bound kernels a step at their isolated sweep seconds, the sweep's sustained factor)."""
    ev = collect_run(run)
    cfg = ev.config
    cal = Calibration.from_records([r for e in ev.ranks.values() for r in e.compute], [])
    dtype = cfg.train.params_dtype
    work = chunk_forward(cfg, 0, 0) + chunk_backward(cfg, 0, 0)
    per_microbatch = sum(cal.kernels[(w.op.name, w.op.dims, dtype)] for w in work
                         if isinstance(w.op, Kernel) and w.op.flops > 0)
    return per_microbatch * cfg.num_microbatches, cal.sustained


def in_step_seconds(run: Path) -> float:
    """The trace's GEMM and attention kernels inside its first profiled step's window."""
    graph = read_graph(next((run / "traces").glob("*.json.gz")))
    window = graph.steps[min(graph.steps)]
    return sum(op.end - op.start for ops in graph.streams.values() for op in ops
               if op.kind == "kernel" and window.start <= op.start < window.end
               and any(k in op.name.lower() for k in COMPUTE_KERNELS)) * 1e-6


def main() -> None:
    runs = [Path(r) for r in sys.argv[1:]] or [FIXTURES / r for r in RUNS]
    print("| run | isolated | in the step | in-step slowdown | sweep's sustained factor |")
    print("|---|---|---|---|---|")
    for run in runs:
        name = run.relative_to(FIXTURES) if run.is_relative_to(FIXTURES) else run
        try:
            isolated, sustained = isolated_seconds(run)
        except KeyError as missing:
            print(f"| {name} | its sweep has no record of {missing} | | | |")
            continue
        measured = in_step_seconds(run)
        print(f"| {name} | {isolated * 1e3:.1f} ms | {measured * 1e3:.1f} ms | {measured / isolated:.3f} | "
              f"{sustained:.3f} |", flush=True)
    print(f"command: python {' '.join(sys.argv)}")


if __name__ == "__main__":
    main()
