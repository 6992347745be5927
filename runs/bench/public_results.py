"""Published large-scale training results through `simulate` (issue 18, item 4): predicted vs published step time.

    python runs/bench/public_results.py [--data tests/data/public_results.json]

Each entry of the data file (its source, GPU, model, layout and achieved figure) is simulated on the matching
hardware file (ledger/models/simulate/published.py says how the published step time is implied and what is assumed where
a paper is silent). Prints one row per entry: predicted and published step time, the error, what the published
time comes from, and the assumptions; skipped entries with the reason; then the command.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ledger.models.simulate.published import Comparison, compare_all, load_entries  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", type=Path, default=ROOT / "tests/data/public_results.json")
    args = ap.parse_args()
    start = time.perf_counter()
    results = compare_all(load_entries(args.data))
    print("| entry | GPUs | predicted s | published s | error | published from | assumed |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        if isinstance(r, Comparison):
            print(f"| {r.id} | {r.hardware} x {r.gpus:,} | {r.predicted_s:.2f} | {r.published_s:.2f} | "
                  f"{r.error:+.1%} | "
                  f"{r.published_from} | {', '.join(r.assumptions) or '—'} |")
        else:
            print(f"| {r.id} | — | — | — | skipped | {r.reason} | — |")
    compared = [r for r in results if isinstance(r, Comparison)]
    within = sum(abs(r.error) <= 0.10 for r in compared)
    print(f"\n{len(compared)} compared, {len(results) - len(compared)} skipped; {within} within 10%; mean |error| "
          f"{sum(abs(r.error) for r in compared) / len(compared):.1%}; {time.perf_counter() - start:.0f} s")
    data = args.data.resolve()
    shown = data.relative_to(ROOT) if data.is_relative_to(ROOT) else data
    print(f"command: python3 runs/bench/public_results.py --data {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
