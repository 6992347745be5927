"""The layout search's cost for a 70B model on 1,024 GPUs (issue 18: under 30 s on 2 cores), on the machine at hand.

    python runs/bench/search_layouts.py [--hardware H200] [--gpus 1024] [--model llama3.1-70b] [--seq 4096]
                                        [--gbs 1024] [--top 5] [--exhaustive]

Prints: the valid layouts enumerated and the seconds it took; the memory filter's seconds and how many fit
(ledger.models.simulate.memory_fit: each stage's peak plus rank 0's outside-PyTorch estimate, ledger/models/formulas/
device_memory.py with the hardware file's overheads, against its HBM);
then the search with the calibrated bound (ledger/models/simulate/bound.py): layouts scored and skipped, its seconds,
and the top K with the reason each loses to the first. --exhaustive scores every fitting layout as well and says whether
the top K is the same (it must be: the bound never exceeds the time model's prediction).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.arguments import parse_args  # noqa: E402
from ledger.models.simulate import enumerate_layouts, load_hardware, search  # noqa: E402
from ledger.models.simulate.pricing import Pricing  # noqa: E402
from ledger.present.search_reason import reason_text  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hardware", default="H200")
    ap.add_argument("--gpus", type=int, default=1024)
    ap.add_argument("--model", default="llama3.1-70b")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--gbs", type=int, default=1024)
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--exhaustive", action="store_true")
    args = ap.parse_args()
    hw = load_hardware(args.hardware)
    base = parse_args(["--model", args.model, "--seq-length", str(args.seq), "--global-batch-size", str(args.gbs),
                       "--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather"],
                      megatron_model=True)
    pricing = Pricing(hw)
    fits = pricing.fits
    t0 = time.perf_counter()
    layouts = list(enumerate_layouts(base, args.gpus, gpus_per_node=hw.gpus_per_node))
    t1 = time.perf_counter()
    fitting = sum(fits(c) is True for c in layouts)
    t2 = time.perf_counter()
    print(f"{len(layouts):,} valid layouts in {t1 - t0:.2f} s; memory of all in {t2 - t1:.2f} s: {fitting:,} fit")

    t3 = time.perf_counter()
    result = pricing.search(base, args.gpus, args.top)
    print(f"search: {time.perf_counter() - t3:.1f} s ({result.seconds['enumerate_and_fit']:.1f} enumerate and fit, "
          f"{result.seconds['score']:.1f} bound and score); scored {result.scored:,}, skipped by the bound "
          f"{result.skipped_by_bound:,}; dropped {result.dropped}")
    for r in result.ranked:
        reason = reason_text(r.reason) if r.reason else ""
        print(f"  {r.label:45s} {r.prediction.tokens_per_s:12,.0f} tokens/s  {reason}")
    if args.exhaustive:
        t4 = time.perf_counter()
        every = search(base, args.gpus, fits, pricing.predict, args.top, gpus_per_node=hw.gpus_per_node)
        same = [r.label for r in every.ranked] == [r.label for r in result.ranked]
        print(f"exhaustive: {time.perf_counter() - t4:.1f} s, {every.scored:,} scored; same top {args.top}: {same}")


if __name__ == "__main__":
    main()
