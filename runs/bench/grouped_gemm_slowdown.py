"""A grouped expert GEMM against the dense GEMM of its total shape, from the device's side-by-side timings: the H200
file's `grouped_gemm.slowdown` (ledger/models/simulate/kernel_cost.py prices a grouped GEMM as the dense one times it).

    python runs/bench/grouped_gemm_slowdown.py [--results FILE ...] [--write]

Reads the tables `runs/bench/expert_gemm_forms.py` printed on the H200 (one per call, each ended by its `command:`
line): per call, torch._grouped_mm's time over the dense mm's (the same m, n, k: every expert's rows against one
expert's weight), summed over the GEMMs the call timed (fc1 and fc2 forward, fc1 dgrad); the slowdown is the mean
over calls. Kernel timings only: no training run enters it. --write stores it in ledger/models/hardware/h200.json.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from statistics import mean

ROOT = Path(__file__).resolve().parents[2]
RESULTS = [ROOT / "runs" / "bench" / "results" / "2026-12-04_expert_gemm_forms_h200.txt"]
H200 = ROOT / "ledger" / "models" / "hardware" / "h200.json"
GROUPED, DENSE = "torch._grouped_mm", "dense mm (ceiling)"


def calls(text: str) -> list[dict[tuple[str, str], float]]:
    """Each call's table: (GEMM, form) -> ms."""
    found: list[dict[tuple[str, str], float]] = [{}]
    for line in text.splitlines():
        if line.startswith("command:"):
            found.append({})
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1] in (GROUPED, DENSE):
            found[-1][(cells[0], cells[1])] = float(cells[2])
    return [c for c in found if c]


def slowdown(call: dict[tuple[str, str], float]) -> float:
    gemms = sorted({g for g, form in call if (g, GROUPED) in call and (g, DENSE) in call})
    if not gemms:
        raise ValueError("a call times no GEMM both grouped and dense")
    return sum(call[(g, GROUPED)] for g in gemms) / sum(call[(g, DENSE)] for g in gemms)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--results", nargs="+", type=Path, default=RESULTS)
    ap.add_argument("--write", action="store_true", help="store the slowdown in ledger/models/hardware/h200.json")
    args = ap.parse_args(argv)
    try:
        tables = [c for path in args.results for c in calls(path.read_text())]
        per_call = [slowdown(c) for c in tables]
    except (OSError, ValueError) as e:
        print(f"grouped_gemm_slowdown: {e}", file=sys.stderr)
        return 2
    if not per_call:
        print("grouped_gemm_slowdown: no expert_gemm_forms.py table in the files given", file=sys.stderr)
        return 2
    value = round(mean(per_call), 4)
    names = ", ".join(str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p) for p in args.results)
    for i, s in enumerate(per_call, 1):
        print(f"call {i}: torch._grouped_mm / dense mm of the same shape = {s:.4f}")
    print(f"grouped_gemm.slowdown = {value} (mean of {len(per_call)} call(s))")
    print("command: python3 runs/bench/grouped_gemm_slowdown.py" + (" --write" if args.write else ""))
    if args.write:
        h200 = json.loads(H200.read_text())
        h200["grouped_gemm"] = {
            "source": f"measured by `python3 runs/bench/expert_gemm_forms.py` on one H200 ({names}; "
                      f"`python3 runs/bench/grouped_gemm_slowdown.py --write`): torch._grouped_mm over 8 experts' "
                      f"rows against one dense mm of the same m, n, k, timed side by side, summed over fc1 and fc2 "
                      f"forward and fc1 dgrad at mixtral-8x7b's expert shape, the mean of {len(per_call)} calls "
                      f"({', '.join(f'{s:.3f}' for s in per_call)}); kernel timings only, no training run",
            "slowdown": value}
        H200.write_text(json.dumps(h200, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
