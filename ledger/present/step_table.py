"""The "Where the step went" table of report.md and report.html: per rank and profiled step, the terms of the step
decomposition (docs/formulas.md, "Step decomposition"), each beside the time model's twin where it predicts one, their
sum, which is the measured step, the twin's sum, and the replay of the rank's execution graph with its critical path;
and beneath it the device-compute term cut by compute class, each beside the time model's; all read from the
reconciliation's rows."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from common.ops.compute_class import CLASSES
from ledger.present import units
from ledger.reconcile.step_decomposition import CLASS_METRIC, REPLAY_METRIC, TERM_METRIC, class_of, term_of

INTRO = ("Each profiled step's window (ProfilerStep#N) cut into terms that add up to it: every instant goes to one "
         "term, by the priority of docs/formulas.md, \"Step decomposition\". \"replayed\" is the rank's execution "
         "graph re-run from its measured durations (\"Replay\" there); its critical path, below, is the chain of "
         "host and device work that made the step as long as it was. After a term, \"model\" is the time model's "
         "prediction of it (its twin, priced from the config and calibration alone), where it has one.")
CLASS_INTRO = ("Each profiled step's device compute (the first term above) cut by what ran, each kernel by the op "
               "that launched it (docs/formulas.md, \"Device compute by class\"): the GEMMs (matmul), fused "
               "attention, the optimizer's update and every other kernel. \"model\" is the time model's kernels of "
               "the class: the compute sweep's isolated times, slowed by the power limit's factor at the step's "
               "compute-bound share (docs/formulas.md, \"The power limit in a step\"; the update not).")


@dataclass
class StepTable:
    head: list[str]
    body: list[list[str]]
    paths: list[str]  # per rank and step, the replay row's explanation (critical path)


def _collect(rows: list[dict[str, Any]], prefix: str, name_of: Callable[[str], str]
             ) -> tuple[dict[tuple[int, int], dict[str, float]], dict[tuple[int, int], dict[str, float]]]:
    """Per (rank, step), the measured and the predicted figure of each part the rows of `prefix` name."""
    measured: dict[tuple[int, int], dict[str, float]] = {}
    twins: dict[tuple[int, int], dict[str, float]] = {}
    for r in rows:
        if r["metric"].startswith(prefix):
            key, part = (r["rank"], r["step"]), name_of(r["metric"])
            measured.setdefault(key, {})[part] = r["measured"]
            if r.get("predicted") is not None:
                twins.setdefault(key, {})[part] = r["predicted"]
    return measured, twins


def _cells(parts: list[str], found: dict[str, float], twin: dict[str, float]) -> list[str]:
    total = sum(found.values())
    return [f"{units.duration(found.get(t, 0.0))} ({found.get(t, 0.0) / total if total else 0.0:.1%})"
            + (f"; model {units.duration(twin[t])}" if t in twin else "") for t in parts]


def _parts(measured: dict[tuple[int, int], dict[str, float]], order: tuple[str, ...] = ()) -> list[str]:
    """The parts any step took time in, in `order` where it names them, else as the rows give them."""
    found = list(dict.fromkeys(t for parts in measured.values() for t in parts
                               if any(s.get(t) for s in measured.values())))
    return sorted(found, key=lambda t: order.index(t) if t in order else len(order))


def step_table(rows: list[dict[str, Any]]) -> StepTable | None:
    """The table of the rows' step decompositions, or None when the reconciliation has none (no trace)."""
    steps, twins = _collect(rows, TERM_METRIC, term_of)
    replays = {(r["rank"], r["step"]): r for r in rows if r["metric"] == REPLAY_METRIC}
    if not steps:
        return None
    terms = _parts(steps)
    modelled = bool(twins)
    head = ["rank", "step", *terms, "sum = measured step", *(["model's sum"] if modelled else []), "replayed"]
    body, paths = [], []
    for (rank, step), found in sorted(steps.items()):
        twin = twins.get((rank, step), {})
        replay = replays.get((rank, step))
        replayed = (f"{units.duration(replay['predicted'])} "
                    f"({units.percent(replay['predicted'] / replay['measured'] - 1, signed=True)})"
                    if replay else units.DASH)
        sums = [units.duration(sum(twin.values())) if twin else units.DASH] if modelled else []
        body.append([str(rank), str(step), *_cells(terms, found, twin), units.duration(sum(found.values())), *sums,
                     replayed])
        if replay:
            paths.append(f"rank {rank}, step {step}: {replay['explanation'].split('; critical path: ', 1)[-1]}")
    return StepTable(head, body, paths)


def class_table(rows: list[dict[str, Any]]) -> StepTable | None:
    """Per rank and profiled step, its device compute by compute class beside the time model's, or None when the
    reconciliation has no such rows."""
    steps, twins = _collect(rows, CLASS_METRIC, class_of)
    if not steps:
        return None
    classes = _parts(steps, CLASSES)
    modelled = bool(twins)
    head = ["rank", "step", *classes, "sum = device compute", *(["model's sum"] if modelled else [])]
    body = []
    for (rank, step), found in sorted(steps.items()):
        twin = twins.get((rank, step), {})
        sums = [units.duration(sum(twin.values())) if twin else units.DASH] if modelled else []
        body.append([str(rank), str(step), *_cells(classes, found, twin), units.duration(sum(found.values())),
                     *sums])
    return StepTable(head, body, [])
