"""The "Where the step went" table of report.md and report.html: per rank and profiled step, the terms of the step
decomposition (docs/formulas.md, "Step decomposition"), each beside the time model's twin where it predicts one, their
sum, which is the measured step, the twin's sum, and the replay of the rank's execution graph with its critical path,
all read from the reconciliation's rows."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ledger.present import units
from ledger.reconcile.step_decomposition import REPLAY_METRIC, TERM_METRIC, term_of

INTRO = ("Each profiled step's window (ProfilerStep#N) cut into terms that add up to it: every instant goes to one "
         "term, by the priority of docs/formulas.md, \"Step decomposition\". \"replayed\" is the rank's execution "
         "graph re-run from its measured durations (\"Replay\" there); its critical path, below, is the chain of "
         "host and device work that made the step as long as it was. After a term, \"model\" is the time model's "
         "prediction of it (its twin, priced from the config and calibration alone), where it has one.")


@dataclass
class StepTable:
    head: list[str]
    body: list[list[str]]
    paths: list[str]  # per rank and step, the replay row's explanation (critical path)


def step_table(rows: list[dict[str, Any]]) -> StepTable | None:
    """The table of the rows' step decompositions, or None when the reconciliation has none (no trace)."""
    steps: dict[tuple[int, int], dict[str, float]] = {}
    twins: dict[tuple[int, int], dict[str, float]] = {}
    replays: dict[tuple[int, int], dict[str, Any]] = {}
    for r in rows:
        key = (r["rank"], r["step"])
        if r["metric"].startswith(TERM_METRIC):
            steps.setdefault(key, {})[term_of(r["metric"])] = r["measured"]
            if r.get("predicted") is not None:
                twins.setdefault(key, {})[term_of(r["metric"])] = r["predicted"]
        elif r["metric"] == REPLAY_METRIC:
            replays[key] = r
    if not steps:
        return None
    terms = list(dict.fromkeys(t for found in steps.values() for t in found if any(s.get(t) for s in steps.values())))
    modelled = bool(twins)
    head = ["rank", "step", *terms, "sum = measured step", *(["model's sum"] if modelled else []), "replayed"]
    body, paths = [], []
    for (rank, step), found in sorted(steps.items()):
        total, twin = sum(found.values()), twins.get((rank, step), {})
        cells = [f"{units.duration(found.get(t, 0.0))} ({found.get(t, 0.0) / total:.1%})"
                 + (f"; model {units.duration(twin[t])}" if t in twin else "") for t in terms]
        replay = replays.get((rank, step))
        replayed = (f"{units.duration(replay['predicted'])} "
                    f"({units.percent(replay['predicted'] / replay['measured'] - 1, signed=True)})"
                    if replay else units.DASH)
        sums = [units.duration(sum(twin.values())) if twin else units.DASH] if modelled else []
        body.append([str(rank), str(step), *cells, units.duration(total), *sums, replayed])
        if replay:
            paths.append(f"rank {rank}, step {step}: {replay['explanation'].split('; critical path: ', 1)[-1]}")
    return StepTable(head, body, paths)
