"""`train-ledger whatif` on every committed run directory with traces: per change, each profiled step's measured
window, its replay and the what-if (docs/formulas.md, "What if on the graph"), and the wall time of each answer.
Torch-free; runs anywhere from the repository root:

    python3 runs/bench/what_if_fixtures.py
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.errors import UserError  # noqa: E402
from ledger.evidence.read import read_run  # noqa: E402
from ledger.models.graph_what_if import Change, what_if  # noqa: E402

FIXTURES = ROOT / "tests/fixtures"
RUNS = ["h200_2layer_profiled", "gpu_h200_llama1b_l2", "megatron_lm_1gpu", "gloo_pp2_sweeps"]
CHANGES = {"kernels 2x": Change(kernels=2.0), "communication 2x": Change(comm=2.0),
           "no launch gaps": Change(no_launch_gaps=True),
           "kernels 2x, no launch gaps": Change(kernels=2.0, no_launch_gaps=True)}


def main() -> None:
    print("| run | change | rank: step measured / replayed / what if (ms) | wall |")
    print("|---|---|---|---|")
    for run in RUNS:
        ev = read_run(FIXTURES / run)
        for name, change in CHANGES.items():
            started = time.perf_counter()
            try:
                answer = what_if(ev, change)
            except UserError as exc:
                print(f"| `{run}` | {name} | refused: {getattr(exc, 'problem', exc)} | |")
                continue
            steps = "; ".join(f"{s.rank}: {s.step} {s.measured * 1e3:.1f} / {s.replayed * 1e3:.1f} / "
                              f"{s.what_if * 1e3:.1f}" for s in answer.steps)
            print(f"| `{run}` | {name} | {steps} | {time.perf_counter() - started:.1f} s |")


if __name__ == "__main__":
    main()
