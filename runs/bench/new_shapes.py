"""Shapes no committed run has had, for judging `simulate` the way held-out runs judge it: the predictions are
written from config and the hardware file before the device runs them (BENCHMARKS.md, 2026-12-04 third entry).

    python3 runs/bench/new_shapes.py [--set SET] --predict       # a line a shape: simulate's step and peak, the command
    python3 runs/bench/new_shapes.py [--set SET] --flags NAME    # the shape's training flags (new_shapes_h200.sh)
    python3 runs/bench/new_shapes.py [--set SET] --names         # the shapes' names, in run order

The first set (2026-12-04): two launch-bound shapes (hidden 768-1024, the GPU idle much of the step), two in between
and two GPU-bound ones. The power set (2026-12-05): four GPU-bound shapes of other widths, lengths and batches,
predicted at the power limit's factor of each step's own compute-bound share and, beside it, at the sweep's full-load
factor (the model before the threshold was measured), so that the runs judge the two. The coverage set (2026-12-05):
five shapes of parts no committed GPU run had exercised (COVERAGE_SHAPES says which). The short set (2026-12-05):
three launch-bound shapes at seq 256-1024, two of them under CUDA graphs. The H100 set (2026-12-05): six of those
shapes again on an H100, predicted from the H100 file (--hardware H100); the second H100 set six more, predicted from
its final form before they ran. Every run as
runs/bench/new_shapes_h200.sh trains it (bf16, distributed optimizer, AdamW, --all-probes).
"""
from __future__ import annotations

import argparse
import dataclasses
import shlex
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.arguments import parse_args  # noqa: E402
from common.errors import ConfigError  # noqa: E402
from ledger.models.simulate.hardware import load_hardware  # noqa: E402
from ledger.models.simulate.simulation import simulate  # noqa: E402

TRAIN = ["--bf16", "--use-distributed-optimizer", "--lr", "3e-4", "--min-lr", "3e-5", "--lr-warmup-iters", "1",
         "--weight-decay", "0.1", "--clip-grad", "1.0", "--all-probes"]
SMALL = ["--model", "llama3.2-1b", "--num-query-groups", "4"]
SHAPES = {
    "lb_h1024_l8_s1024_mbs4": SMALL + ["--num-layers", "8", "--hidden-size", "1024", "--ffn-hidden-size", "4096",
                                       "--num-attention-heads", "16", "--seq-length", "1024", "--micro-batch-size",
                                       "4", "--global-batch-size", "16"],
    "lb_h768_l6_s512_mbs8": SMALL + ["--num-layers", "6", "--hidden-size", "768", "--ffn-hidden-size", "3072",
                                     "--num-attention-heads", "12", "--seq-length", "512", "--max-position-embeddings",
                                     "512", "--micro-batch-size", "8", "--global-batch-size", "32"],
    "mid_llama1b_l8_s2048_mbs2": ["--model", "llama3.2-1b", "--num-layers", "8", "--seq-length", "2048",
                                  "--micro-batch-size", "2", "--global-batch-size", "8"],
    "mid_h1536_l12_s1024_mbs2": SMALL + ["--num-layers", "12", "--hidden-size", "1536", "--ffn-hidden-size", "6144",
                                         "--num-attention-heads", "12", "--seq-length", "1024", "--micro-batch-size",
                                         "2", "--global-batch-size", "16"],
    "gb_llama1b_s4096_mbs2": ["--model", "llama3.2-1b", "--seq-length", "4096", "--micro-batch-size", "2",
                              "--global-batch-size", "16"],
    "gb_llama8b_l2_s4096": ["--model", "llama3.1-8b", "--num-layers", "2", "--seq-length", "4096",
                            "--micro-batch-size", "1", "--global-batch-size", "4"],
}

POWER_SHAPES = {
    "pw_llama8b_l2_s8192": ["--model", "llama3.1-8b", "--num-layers", "2", "--seq-length", "8192",
                            "--micro-batch-size", "1", "--global-batch-size", "4"],
    "pw_llama1b_l8_s4096_mbs2": ["--model", "llama3.2-1b", "--num-layers", "8", "--seq-length", "4096",
                                 "--micro-batch-size", "2", "--global-batch-size", "8"],
    "pw_h5120_l2_s2048_mbs2": ["--model", "llama3.1-8b", "--num-layers", "2", "--hidden-size", "5120",
                               "--ffn-hidden-size", "13824", "--num-attention-heads", "40", "--seq-length", "2048",
                               "--micro-batch-size", "2", "--global-batch-size", "8"],
    "pw_llama1b_s1024_mbs8": ["--model", "llama3.2-1b", "--seq-length", "1024", "--micro-batch-size", "8",
                              "--global-batch-size", "32"],
}
# The coverage set (2026-12-05): parts of the engine no committed GPU run had exercised: core attention filling the
# step (hidden 1024 at seq 16,384), head dimension 128 on a small model, fine-grained grouped experts (16 of width
# 3,584, top 4), a launch-bound shape under CUDA graphs, and full multi-head attention (no query groups) with a
# 50,304 vocabulary at hidden 2048 (the engine builds the Llama layer only: an explicit shape is Llama's).
COVERAGE_SHAPES = {
    "cv_h1024_l4_s16384": SMALL + ["--num-layers", "4", "--hidden-size", "1024", "--ffn-hidden-size", "4096",
                                   "--num-attention-heads", "16", "--seq-length", "16384", "--micro-batch-size", "1",
                                   "--global-batch-size", "4"],
    "cv_hd128_l4_s8192": ["--model", "llama3.2-1b", "--num-layers", "4", "--num-attention-heads", "16",
                          "--seq-length", "8192", "--micro-batch-size", "1", "--global-batch-size", "8"],
    "cv_moe_e16_top4_grouped": ["--model", "mixtral-8x7b-2l", "--num-experts", "16", "--moe-router-topk", "4",
                                "--moe-ffn-hidden-size", "3584", "--moe-aux-loss-coeff", "0.02", "--moe-grouped-gemm",
                                "--seq-length", "4096", "--micro-batch-size", "1", "--global-batch-size", "8"],
    "cv_lb_h768_l8_s256_graphed": SMALL + ["--num-layers", "8", "--hidden-size", "768", "--ffn-hidden-size", "3072",
                                           "--num-attention-heads", "12", "--seq-length", "256",
                                           "--max-position-embeddings", "256", "--micro-batch-size", "8",
                                           "--global-batch-size", "32", "--cuda-graph-impl", "local"],
    "cv_mha_h2048_l8_s2048": ["--num-layers", "8", "--hidden-size", "2048", "--ffn-hidden-size", "8192",
                              "--num-attention-heads", "16", "--vocab-size", "50304", "--seq-length", "2048",
                              "--max-position-embeddings", "2048", "--micro-batch-size", "2", "--global-batch-size",
                              "8"],
}
# The short-sequence set (2026-12-05, fourth): launch-bound shapes at seq 256-1024, two under CUDA graphs and one eager,
# predicted with flash attention priced from the grid's short sequences (hardware_sweep.py --short-attention).
SHORT_SHAPES = {
    "ss_h768_l6_s1024_mbs2_graphed": SMALL + ["--num-layers", "6", "--hidden-size", "768", "--ffn-hidden-size",
                                              "3072", "--num-attention-heads", "12", "--seq-length", "1024",
                                              "--max-position-embeddings", "1024", "--micro-batch-size", "2",
                                              "--global-batch-size", "8", "--cuda-graph-impl", "local"],
    "ss_h1024_l8_s256_mbs8_graphed": SMALL + ["--num-layers", "8", "--hidden-size", "1024", "--ffn-hidden-size",
                                              "4096", "--num-attention-heads", "16", "--seq-length", "256",
                                              "--max-position-embeddings", "256", "--micro-batch-size", "8",
                                              "--global-batch-size", "32", "--cuda-graph-impl", "local"],
    "ss_h1024_l6_s256_mbs8": SMALL + ["--num-layers", "6", "--hidden-size", "1024", "--ffn-hidden-size", "4096",
                                      "--num-attention-heads", "16", "--seq-length", "256",
                                      "--max-position-embeddings", "256", "--micro-batch-size", "8",
                                      "--global-batch-size", "32"],
}
# The H100 set (2026-12-05, seventh): shapes of the sets above, held out for the H100 file measured by
# runs/bench/hardware_calibration.sh on an H100 (none of its inputs is a training run): the dense 1B at seq 4096 (the
# issue's shape, GPU-bound), two GPU-bound shapes of other widths, one in between, and two launch-bound ones at seq
# 256, eager and under CUDA graphs.
H100_SHAPES = {
    "h1_llama1b_s4096": ["--model", "llama3.2-1b", "--seq-length", "4096", "--micro-batch-size", "1",
                         "--global-batch-size", "8"],
    "pw_llama8b_l2_s8192": POWER_SHAPES["pw_llama8b_l2_s8192"],
    "pw_h5120_l2_s2048_mbs2": POWER_SHAPES["pw_h5120_l2_s2048_mbs2"],
    "lb_h1024_l8_s1024_mbs4": SHAPES["lb_h1024_l8_s1024_mbs4"],
    "ss_h1024_l6_s256_mbs8": SHORT_SHAPES["ss_h1024_l6_s256_mbs8"],
    "ss_h1024_l8_s256_mbs8_graphed": SHORT_SHAPES["ss_h1024_l8_s256_mbs8_graphed"],
}
# The second H100 set (2026-12-05, seventh): six more shapes of the earlier sets, predicted from the H100 file's final
# form (its three calibration runs' contexts, its measured power limit) and committed before the device ran them.
H100_SECOND_SHAPES = {
    "mid_llama1b_l8_s2048_mbs2": SHAPES["mid_llama1b_l8_s2048_mbs2"],
    "mid_h1536_l12_s1024_mbs2": SHAPES["mid_h1536_l12_s1024_mbs2"],
    "lb_h768_l6_s512_mbs8": SHAPES["lb_h768_l6_s512_mbs8"],
    "cv_hd128_l4_s8192": COVERAGE_SHAPES["cv_hd128_l4_s8192"],
    "ss_h768_l6_s1024_mbs2_graphed": SHORT_SHAPES["ss_h768_l6_s1024_mbs2_graphed"],
    "pw_llama1b_s1024_mbs8": POWER_SHAPES["pw_llama1b_s1024_mbs8"],
}
SETS = {"2026-12-04": SHAPES, "power": POWER_SHAPES, "coverage": COVERAGE_SHAPES, "short": SHORT_SHAPES,
        "h100": H100_SHAPES, "h100-second": H100_SECOND_SHAPES}


def flags(name: str, shapes: dict[str, list[str]] = SHAPES) -> list[str]:
    return TRAIN + shapes[name]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = ap.add_mutually_exclusive_group(required=True)
    what.add_argument("--predict", action="store_true")
    what.add_argument("--flags", metavar="NAME")
    what.add_argument("--names", action="store_true")
    ap.add_argument("--set", choices=sorted(SETS), default="2026-12-04")
    ap.add_argument("--hardware", default="H200", help="the hardware file --predict prices with (default H200)")
    args = ap.parse_args()
    shapes = SETS[args.set]
    if args.names:
        print(" ".join(shapes))
    elif args.flags is not None:
        if args.flags not in shapes:
            print(f"new_shapes.py: no shape {args.flags!r} (known: {', '.join(shapes)})", file=sys.stderr)
            return 2
        print(shlex.join(flags(args.flags, shapes)))
    else:
        try:
            hw = load_hardware(args.hardware)
        except ConfigError as e:
            print(f"new_shapes.py: {e}", file=sys.stderr)
            return 2
        full = dataclasses.replace(hw, sustained=dataclasses.replace(hw.sustained, threshold_share=None))
        for name in shapes:
            try:
                sim, at_full = (simulate(parse_args(flags(name, shapes), world_size=1), h) for h in (hw, full))
            except ConfigError as e:
                print(f"new_shapes.py: {name}: {e}", file=sys.stderr)
                return 2
            peak = max(m.peak.total for m in sim.memory)
            print(f"{name}: step {sim.step.step_time * 1e3:.1f} ms (kernels x{sim.step.power_factor:.3f}; at the "
                  f"full-load factor x{at_full.step.power_factor:.3f}: {at_full.step.step_time * 1e3:.1f} ms), "
                  f"peak {peak / 2**30:.2f} GiB")
        print("command: python3 runs/bench/new_shapes.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
