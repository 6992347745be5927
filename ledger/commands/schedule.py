"""`train-ledger schedule`: a pipeline schedule's per-stage event order, its global-clock chart and its bubble.

The order is the engine's own schedule plan (engine/pipeline_parallel/schedule_plan.py, torch-free), the plan the
real schedules execute; the chart replays it with every forward and backward taking one cell and starting as soon
as its stage is free and its inputs exist. The bubble is read off the chart and set beside the closed form.
"""
from __future__ import annotations

import json

from ledger.commands._args import CommandParser

IDLE = "."


def _bubble_formula(p: int, m: int, v: int) -> str:
    if v == 1:
        return f"(p-1)/(m+p-1) = {p - 1}/{m + p - 1}"
    return f"(p-1)/(V*m+p-1) = {p - 1}/{v * m + p - 1}"


def main(argv: list[str]) -> int:
    from engine.pipeline_parallel.schedule_plan import (analytic_bubble_fraction, bubble_fraction, schedule_plan,
                                                        simulate)

    parser = CommandParser("schedule", description="a pipeline schedule's event order, chart and bubble")
    parser.add_argument("--pp", type=int, required=True, help="pipeline stages p")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches per step m")
    parser.add_argument("--vpp", type=int, default=1, help="model chunks per stage V (interleaved when > 1)")
    parser.add_argument("--json", action="store_true")
    a = parser.parse_args(argv)
    plans = schedule_plan(a.pp, a.microbatches, a.vpp)
    clock = simulate(plans, a.vpp)
    chunked = a.vpp > 1
    events = [[item.label(chunked) for item in plan.items] for plan in plans]
    cells = [[IDLE if item is None else item.label(chunked) for item in row] for row in clock]
    chart_bubble = bubble_fraction(clock)
    analytic = analytic_bubble_fraction(a.pp, a.microbatches, a.vpp)
    if a.json:
        print(json.dumps({"stages": [{"stage": s, "events": e} for s, e in enumerate(events)], "clock": cells,
                          "bubble_fraction": chart_bubble, "analytic_bubble_fraction": analytic}))
        return 0

    name = f"interleaved 1F1B, {a.vpp} chunks per stage" if chunked else "1F1B"
    print(f"{name}: pp={a.pp}, microbatches={a.microbatches}")
    print("event order per stage (warmup forwards, then one forward / one backward, then the cooldown backwards;"
          + (" FmcK = micro-batch m on chunk K)" if chunked else " Fm / Bm = micro-batch m)"))
    for plan, e in zip(plans, events):
        print(f"  stage {plan.stage} (warmup {plan.num_warmup}): {' '.join(e)}")
    width = max(len(c) for row in cells for c in row + [str(len(row) - 1)])
    label = len(f"stage {a.pp - 1}")
    print(f"global clock (one cell = one forward or backward of one {'chunk' if chunked else 'stage'}; "
          f"{IDLE} = idle):")
    print(f"  {'t':<{label}} " + " ".join(f"{t:<{width}}" for t in range(len(cells[0]))))
    for s, row in enumerate(cells):
        print(f"  {f'stage {s}':<{label}} " + " ".join(f"{c:<{width}}" for c in row))
    idle = sum(c == IDLE for row in cells for c in row)
    total = sum(len(row) for row in cells)
    print("bubble fraction = idle cells / all cells (stages x clock length), forward and backward of equal cost:")
    print(f"  chart:    {chart_bubble:.4f} ({idle} of {total} cells)")
    print(f"  analytic: {analytic:.4f} = {_bubble_formula(a.pp, a.microbatches, a.vpp)}"
          + ("  [per chunk; relative to the ideal time it is (p-1)/(V*m)]" if chunked else ""))
    return 0
