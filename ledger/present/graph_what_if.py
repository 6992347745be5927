"""What if on the measured graph (ledger.models.graph_what_if), for people: the text `train-ledger whatif` prints and
the table the dashboard's "What if" page shows, each figure written by ledger.present.units."""
from __future__ import annotations

from typing import Any

from ledger.models.graph_what_if import Change, WhatIfAnswer, what_if
from ledger.present import units as fmt
from ledger.present.loaders import RunView

COLUMNS = ("rank", "step", "measured", "replayed", "what if", "change")


def table(answer: WhatIfAnswer) -> list[dict[str, str]]:
    """One row per traced rank and profiled step: the measured window, the replayed baseline, the what-if."""
    return [{"rank": str(s.rank), "step": str(s.step), "measured": fmt.duration(s.measured),
             "replayed": fmt.duration(s.replayed), "what if": fmt.duration(s.what_if),
             "change": fmt.percent(s.gain, signed=True)} for s in answer.steps]


def job_lines(answer: WhatIfAnswer) -> list[str]:
    """The job's step, each profiled step's slowest rank, replayed and what-if."""
    return [f"step {n}: {fmt.duration(base)} -> {fmt.duration(changed)} "
            f"({fmt.percent((changed - base) / base if base else 0.0, signed=True)})"
            for n, (base, changed) in sorted(answer.job_steps().items())]


def render(answer: WhatIfAnswer, run: str) -> str:
    rows = table(answer)
    lines = [f"what if, on the execution graph of {run} (traced ranks {fmt.ranks(answer.ranks)}):", "changed:"]
    lines += [f"  {text}" for text in answer.changed]
    lines += ["", "| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(r[c] for c in COLUMNS) + " |" for r in rows]
    lines += ["", "the job (each step's slowest rank), replayed -> what if: " + "; ".join(job_lines(answer))]
    lines += [f"note: {text}" for text in answer.notes]
    lines.append("measured: the ProfilerStep window; replayed: the execution graph re-run from its measured durations; "
                 "what if: the same replay with the change (docs/formulas.md, \"What if on the graph\")")
    return "\n".join(lines)


def replay_what_if(view: RunView, change: Change) -> dict[str, Any]:
    """The dashboard's loader: what changed, the table, the job's steps and the notes (plain values)."""
    answer = what_if(view.evidence, change)
    return {"changed": answer.changed, "table": table(answer), "job": job_lines(answer), "notes": answer.notes}
