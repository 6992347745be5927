"""An MoE expert's SwiGLU as the engine runs it (one function compiled for any row count) or eager (silu and a
multiply, three kernels a pass): the engine's training step with the experts' activation swapped, to weigh the
compiled call's host cost (guards on a symbolic row count) against the eager chain's extra memory passes where
SequentialMLP's host paces its forward (BENCHMARKS.md, 2026-12-04 fourth entry).

    python3 -m torch.distributed.run --standalone --nproc-per-node 1 runs/bench/expert_activation.py \\
        --variant compiled|eager ENGINE_TRAIN_FLAGS...
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Sequence

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from engine import probe_adapters  # noqa: E402
from engine.train import main  # noqa: E402
from engine.transformer import mlp  # noqa: E402

VARIANTS = {"compiled": mlp.swiglu_any_rows, "eager": mlp._swiglu}


def take_variant(argv: list[str], variants: Sequence[str], script: str) -> tuple[str, list[str]]:
    """--variant's value, one of `variants`, and argv without it (the engine's flags); one line and exit 2 else."""
    i = argv.index("--variant") if "--variant" in argv else len(argv)
    variant = argv[i + 1] if i + 1 < len(argv) else None
    if variant not in variants:
        print(f"{script}: --variant {variant or '(missing)'}: one of {', '.join(variants)}", file=sys.stderr)
        raise SystemExit(2)
    return variant, argv[:i] + argv[i + 2:]


def swap(argv: list[str]) -> list[str]:
    """Set the experts' activation from --variant (removed from argv); the rest is the engine's."""
    variant, rest = take_variant(argv, list(VARIANTS), "expert_activation.py")
    mlp.swiglu_any_rows = probe_adapters.swiglu_any_rows = VARIANTS[variant]
    return rest


if __name__ == "__main__":
    sys.exit(main(swap(sys.argv[1:])))
