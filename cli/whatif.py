"""`train-ledger whatif RUN`: the run's profiled steps replayed from its own execution graph with a change.

    train-ledger whatif RUN [--kernels-faster K] [--matmul-faster K] [--attention-faster K] [--comm-faster K]
                            [--no-launch-gaps] [--no-straggler] [--json]

Per traced rank and profiled step it prints the measured step (the ProfilerStep window), the replay from the
measured durations and the replay with the change, and what the change touched (ledger/models/graph_what_if.py;
docs/formulas.md, "What if on the graph"). `simulate` predicts a layout on paper; this changes a run as it ran.
"""
from __future__ import annotations

import argparse
import json
import math

from cli.args import CommandParser


def speed_up(text: str) -> float:
    """A speed-up factor: a positive finite number (2: twice as fast)."""
    try:
        k = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (math.isfinite(k) and k > 0):
        raise argparse.ArgumentTypeError(f"{text}: a speed-up is a positive finite number (2: twice as fast)")
    return k


def main(argv: list[str]) -> int:
    from ledger.evidence.read import read_run
    from ledger.models.graph_what_if import Change, what_if
    from ledger.present.graph_what_if import render

    p = CommandParser("whatif", description=__doc__.splitlines()[0])
    p.add_argument("run", metavar="RUN")
    p.add_argument("--kernels-faster", type=speed_up, default=1.0, metavar="K",
                   help="every GPU kernel but NCCL's K times faster (a CPU run: its compute ops)")
    p.add_argument("--matmul-faster", type=speed_up, default=1.0, metavar="K",
                   help="the GEMMs K times faster, on top of --kernels-faster (kernels launched by aten::mm, addmm, "
                        "bmm, ...; a CPU run: those ops)")
    p.add_argument("--attention-faster", type=speed_up, default=1.0, metavar="K",
                   help="fused attention K times faster, on top of --kernels-faster (kernels launched by the "
                        "scaled-dot-product attention ops; a CPU run: those ops)")
    p.add_argument("--comm-faster", type=speed_up, default=1.0, metavar="K",
                   help="communication K times faster (NCCL kernels' transfers; a CPU run: gloo ranges, c10d calls)")
    p.add_argument("--no-launch-gaps", action="store_true",
                   help="no host time between launches, as CUDA graphs would have it (GPU runs)")
    p.add_argument("--no-straggler", action="store_true",
                   help="the rank with the most device compute in a step brought to the median rank's (GPU traces of "
                        "two or more ranks of one host)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    change = Change(a.kernels_faster, a.comm_faster, a.no_launch_gaps, a.no_straggler, a.matmul_faster,
                    a.attention_faster).checked()
    answer = what_if(read_run(a.run), change)
    print(json.dumps({"run": a.run, **answer.to_dict()}, indent=1) if a.json else render(answer, a.run))
    return 0
