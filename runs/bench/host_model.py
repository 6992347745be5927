"""The host timeline calibrated on some real runs and judged on the others: one factor fitted, the rest predicted.

    python3 runs/bench/host_model.py --calibrate RUN [RUN ...] --validate RUN [RUN ...] [--hardware H200]

The time model prices each catalogue entry's host work as its recipe's primitives (ledger/models/time_model/
host_recipe.py for this engine, megatron_host_recipe.py for Megatron-LM's local layers) at the host's costs (the run's
host sweep, else the hardware file's `host` block); the recipes' CONTEXT scales them for the Python around those
calls. --calibrate fits CONTEXT alone, on the named runs' measured step times (median of their steady steps; least
squares in log), and prints it for the recipes' file; --validate prints each other run's step, forward, backward and
optimizer ranges predicted with that factor against measured (the run's own timers, unprofiled steps), for
BENCHMARKS.md. A run is never in both lists, and all are of one code (this engine's or Megatron-LM's).

--write stores a Megatron-LM fit in the --hardware file's host block (`host.megatron_context`, which the host timeline
prices Megatron-LM's runs on that host with): the recipes' CONTEXT is a fit against one host block's primitives (the
H200's), so another host's block needs its own (this engine's are host_contexts.py's `engine_contexts`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.errors import UserError  # noqa: E402
from ledger.evidence.read import read_run  # noqa: E402
from ledger.evidence.run import RunEvidence  # noqa: E402
from ledger.evidence.steps import select_steps  # noqa: E402
from ledger.models.simulate.calibration import hardware_calibration  # noqa: E402
from ledger.models.simulate.fit import factor_minimising  # noqa: E402
from ledger.models.simulate.hardware import hardware_file, load_hardware, write_hardware_json  # noqa: E402
from ledger.models.time_model import (  # noqa: E402
    Calibration,
    StepPrediction,
    host_recipe,
    megatron_host_recipe,
    predict_step,
)
from ledger.models.time_model.host_costs import host_costs  # noqa: E402

PHASES = ("forward", "backward", "optimizer")


@dataclasses.dataclass
class Run:
    path: Path
    ev: RunEvidence
    steady: list[int]

    @property
    def step(self) -> float:
        return median(s.step_time_s for r in self.ev.ranks.values() for s in r.steps if s.step in self.steady)

    def phase(self, kind: str) -> float | None:
        found = [t.duration_s for r in self.ev.ranks.values() for t in r.timing
                 if t.category == kind and t.step in self.steady and t.duration_s]
        return median(found) if found else None


def load(path: Path) -> Run:
    ev = read_run(path)
    records = [s for r in ev.ranks.values() for s in r.steps]
    selection = select_steps(ev.config, ev.world_size, records)
    return Run(path, ev, selection.steady(s.step for s in records if s.step_time_s))


def calibration(run: Run, hardware: str, context: float) -> tuple[Calibration, str]:
    """The hardware file's calibration of the run's layout with its host block at `context`, or the run's own host
    sweep where it has one."""
    cal = hardware_calibration(run.ev.config, load_hardware(hardware))
    own, _ = host_costs(h for r in run.ev.ranks.values() for h in r.host)
    host = own or cal.host
    return dataclasses.replace(cal, host=dataclasses.replace(host, context=context)), \
        "own host sweep" if own else "hardware file"


def predict(run: Run, hardware: str, context: float) -> StepPrediction:
    return predict_step(run.ev.config, calibration(run, hardware, context)[0])


def fit(runs: list[Run], hardware: str) -> float:
    """The context that makes the runs' predicted steps meet their measured ones in the least-squares-in-log sense
    (golden-section search over [0.25, 4])."""
    return factor_minimising(
        lambda context: sum(math.log(predict(r, hardware, context).step_time / r.step) ** 2 for r in runs))


def row(run: Run, hardware: str, context: float, role: str) -> str:
    pred = predict(run, hardware, context)
    stage = pred.stages[0]
    cells = [f"{run.path.name} ({role}, {calibration(run, hardware, context)[1]})",
             f"{pred.step_time * 1e3:.4g} / {run.step * 1e3:.4g} ms", f"{(pred.step_time / run.step - 1):+.1%}"]
    for kind, value in zip(PHASES, (stage.forward, stage.backward, stage.optimizer)):
        measured = run.phase(kind)
        cells.append(f"{value * 1e3:.3g} / {measured * 1e3:.3g} ({value / measured - 1:+.0%})" if measured else "—")
    return "| " + " | ".join(cells) + " |"


def write(path: Path, context: float, argv: list[str]) -> None:
    """host.megatron_context of a GPU kind's hardware file, with the command that fitted it."""
    data = json.loads(path.read_text())
    data["host"]["megatron_context"] = {
        "value": round(context, 3),
        "source": f"fitted by `python3 runs/bench/host_model.py {' '.join(argv)}` on the calibration runs' measured "
                  f"steps (the median of their steady steps) against this block's primitives"}
    write_hardware_json(path, data)


def refused(problem: str) -> int:
    print(f"host_model.py: {problem}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calibrate", nargs="+", type=Path, required=True)
    ap.add_argument("--validate", nargs="*", type=Path, default=[])
    ap.add_argument("--hardware", default="H200")
    ap.add_argument("--write", action="store_true", help="store a Megatron-LM fit as host.megatron_context")
    args = ap.parse_args(argv)
    overlap = {p.resolve() for p in args.calibrate} & {p.resolve() for p in args.validate}
    if overlap:
        return refused(f"a run is either calibration or validation: {', '.join(sorted(map(str, overlap)))}")
    try:
        load_hardware(args.hardware)
        calibrating, validating = [load(p) for p in args.calibrate], [load(p) for p in args.validate]
    except UserError as exc:
        return refused(str(exc))
    codes = {r.ev.config.implementation.megatron for r in calibrating + validating}
    if len(codes) > 1:
        return refused("the runs are of two codes (this engine's and Megatron-LM's): one CONTEXT cannot serve both")
    megatron = codes.pop()
    target = hardware_file(args.hardware)
    if args.write and not (megatron and target is not None):
        return refused("--write stores a fit of Megatron-LM's runs in a named GPU's hardware file (H200, H100); "
                       "this engine's contexts are host_contexts.py's")
    recipes = megatron_host_recipe if megatron else host_recipe
    context = fit(calibrating, args.hardware)
    names = ", ".join(r.path.name for r in calibrating)
    file = recipes.__name__.rpartition(".")[2]
    print(f"CONTEXT = {context:.3f}  ({file}.py has {recipes.CONTEXT}); fitted on {names}")
    print("| run | step predicted / measured | error | forward per micro-batch ms | backward | optimizer |")
    print("|---|---|---|---|---|---|")
    for r in calibrating:
        print(row(r, args.hardware, context, "calibration"))
    for r in validating:
        print(row(r, args.hardware, context, "validation"))
    if args.write:
        write(target, context, argv or sys.argv[1:])
        print(f"wrote host.megatron_context of {target.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
