"""`train-ledger schedule`: a pipeline schedule's per-stage event order, its global-clock chart and its bubble.

The order is the ledger's own derivation of Megatron's schedules (ledger/models/schedule.py; tests hold it equal to the
plan the engine executes); the chart replays it with every forward and backward taking one cell and starting as soon as
its stage is free and its inputs exist. The bubble is read off the chart and set beside the closed form.
"""
from __future__ import annotations

import json

from cli.args import CommandParser

IDLE = "."


def main(argv: list[str]) -> int:
    from ledger.models.formulas.bubble import bubble, of_wall_time_text
    from ledger.models.schedule import check_chart, simulate, stage_order, warmup_count

    parser = CommandParser("schedule", description="a pipeline schedule's event order, chart and bubble")
    parser.add_argument("--pp", type=int, required=True, help="pipeline stages p")
    parser.add_argument("--microbatches", type=int, required=True, help="micro-batches per step m")
    parser.add_argument("--vpp", type=int, default=1, help="model chunks per stage V (interleaved when > 1)")
    parser.add_argument("--json", action="store_true")
    a = parser.parse_args(argv)
    check_chart(a.pp, a.microbatches, a.vpp)
    timeline = simulate(a.pp, a.microbatches, a.vpp)
    chunked = a.vpp > 1
    events = [[item.label(chunked) for item in stage_order(a.pp, s, a.microbatches, a.vpp)] for s in range(a.pp)]
    cells = [[IDLE if item is None else item.label(chunked) for item in row] for row in timeline.cells()]
    chart_bubble = timeline.bubble_fraction()
    analytic = bubble(a.pp, a.microbatches, a.vpp).of_wall_time
    if a.json:
        print(json.dumps({"stages": [{"stage": s, "events": e} for s, e in enumerate(events)], "clock": cells,
                          "bubble_fraction": chart_bubble, "analytic_bubble_fraction": analytic}))
        return 0

    name = f"interleaved 1F1B, {a.vpp} chunks per stage" if chunked else "1F1B"
    print(f"{name}: pp={a.pp}, microbatches={a.microbatches}")
    print("event order per stage (warmup forwards, then one forward / one backward, then the cooldown backwards;"
          + (" FmcK = micro-batch m on chunk K)" if chunked else " Fm / Bm = micro-batch m)"))
    for stage, e in enumerate(events):
        print(f"  stage {stage} (warmup {warmup_count(a.pp, stage, a.microbatches, a.vpp)}): {' '.join(e)}")
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
    print(f"  analytic: {analytic:.4f} = {of_wall_time_text(a.pp, a.microbatches, a.vpp)}"
          + ("  [per chunk; relative to the ideal time it is (p-1)/(V*m)]" if chunked else ""))
    return 0
