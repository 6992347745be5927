"""One rank of the engine with the host's other Python work taken away, to see what it costs a launch-bound step.

    python3 -m torch.distributed.run --standalone --nproc-per-node 1 runs/bench/host_contention.py \
        --variant prefetch-all,gc-off -- <engine.train flags>

Variants (comma-separated; `default` changes nothing):
  prefetch-all  the data loader's thread builds every micro-batch of the run before the first step (its queue as
                deep as the run), so it never wakes, takes the interpreter lock or pins memory during a step
  gc-off        Python's cyclic garbage collector frozen and disabled for the run (Megatron's --manual-gc without
                the periodic collection)
The run directory is the engine's own; `train-ledger reconcile` judges it like any other. Used by
runs/bench/host_contention_h200.sh; the step's forward and backward ranges beside the start-up pass timings say
whether the training loop's host work is slower than the same passes alone, and why.
"""
from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

VARIANTS = ("default", "prefetch-all", "gc-off")


def flag(argv: list[str], name: str, default: int) -> int:
    return int(argv[argv.index(name) + 1]) if name in argv else default


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variant", default="default")
    ap.add_argument("engine_argv", nargs=argparse.REMAINDER)
    a = ap.parse_args()
    chosen = set(a.variant.split(","))
    if chosen - set(VARIANTS):
        ap.error(f"--variant: unknown {sorted(chosen - set(VARIANTS))}; choose from {', '.join(VARIANTS)}")
    argv = [x for x in a.engine_argv if x != "--"]
    if "prefetch-all" in chosen:
        import engine.data

        iters, gbs, mbs = (flag(argv, f, d) for f, d in (("--train-iters", 1), ("--global-batch-size", 1),
                                                          ("--micro-batch-size", 1)))
        engine.data.PREFETCH_MIN = iters * (gbs // mbs)  # one rank, no DP: every position of the run
    if "gc-off" in chosen:
        gc.freeze()
        gc.disable()
    from engine.train import main as train

    return train(argv)


if __name__ == "__main__":
    sys.exit(main())
