"""This engine's forward and backward host contexts on a hardware file's host, fitted on its calibration run.

    python3 runs/bench/host_contexts.py --gpu H100 --run tests/fixtures/h100_host_calibration/l2_s1024 [--write]

The host timeline prices a pass as its recipes' primitives at the host block's prices times a context: the Python
around the calls (host_recipe.CONTEXT, fitted once on the H200's calibration step). A block estimated from one
machine's trace can need its own, and a backward pass another than the forward: autograd's engine calls a backward's
nodes from C++, so its Python is inside the nodes the block's primitives were sampled from. This fits the two on the
calibration run's own timer ranges (the mean forward and backward range over its unprofiled steady steps: what the
step adds up; the host paces them there), each by golden-section search, and --write stores them in the file's host
block as `engine_contexts` with their source. Only a run whose passes the host paces says anything: the H200's
calibration run's backward is the device's, so the H200 file keeps host_recipe.CONTEXT for both. A calibration run
is never one the file is judged on (BENCHMARKS.md names the split).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path
from statistics import fmean, median

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.errors import UserError  # noqa: E402
from ledger.evidence.read import read_run  # noqa: E402
from ledger.evidence.run import RunEvidence  # noqa: E402
from ledger.evidence.steps import select_steps  # noqa: E402
from ledger.models.simulate.calibration import hardware_calibration  # noqa: E402
from ledger.models.simulate.fit import factor_minimising  # noqa: E402
from ledger.models.simulate.hardware import (  # noqa: E402
    hardware_file,
    kind_of,
    load_hardware,
    run_device,
    write_hardware_json,
)
from ledger.models.time_model import predict_step  # noqa: E402
from ledger.models.time_model.host_recipe import CONTEXT  # noqa: E402

PASSES = ("forward", "backward")  # the timers' categories


class Refused(ValueError):
    """A run these contexts cannot be fitted on."""


def measured_ranges(ev: RunEvidence) -> dict[str, float]:
    """The mean forward and backward range as the timers measured them over the run's unprofiled steady steps:
    what its steps add up, every micro-batch's (the step's first forward, after the optimizer's read, included)."""
    records = [s for r in ev.ranks.values() for s in r.steps]
    steady = set(select_steps(ev.config, ev.world_size, records).steady(s.step for s in records if s.step_time_s))
    profiled = {s.step for s in records if s.profiled}
    spans = {kind: [t.duration_s for r in ev.ranks.values() for t in r.timing
                    if t.category == kind and t.step in steady - profiled and t.duration_s] for kind in PASSES}
    absent = [kind for kind, found in spans.items() if not found]
    if absent:
        raise Refused(f"the run has no unprofiled steady {' or '.join(absent)} range")
    return {kind: fmean(found) for kind, found in spans.items()}


def fit(ev: RunEvidence, gpu: str) -> dict[str, float]:
    """The forward and backward contexts whose predicted ranges meet the measured ones."""
    if ev.config is None or ev.config.implementation.megatron:
        raise Refused("not a run of this engine (the contexts are its recipes')")
    device = run_device(ev.rank_infos.values())
    if device is None or kind_of(gpu).lower() not in device.lower():
        raise Refused(f"ran on {device or 'an unnamed device'}, not an {gpu}")
    cal = hardware_calibration(ev.config, load_hardware(gpu))
    if cal.host is None:
        raise Refused(cal.host_note or "no host timeline")
    measured = measured_ranges(ev)

    def predicted(forward: float, backward: float) -> dict[str, float]:
        host = dataclasses.replace(cal.host, context=None, engine_contexts=(forward, backward))
        stage = predict_step(ev.config, dataclasses.replace(cal, host=host)).stages[0]
        return {"forward": stage.forward, "backward": stage.backward}

    contexts = {kind: CONTEXT for kind in PASSES}
    for kind in PASSES:  # the forward first, then the backward beside it
        contexts[kind] = factor_minimising(
            lambda x: abs(math.log(predicted(**(contexts | {kind: x}))[kind] / measured[kind])))
    found = predicted(**contexts)
    print(f"{ev.run_dir.name}: " + "; ".join(f"{kind} context {contexts[kind]:.3f} (range {found[kind] * 1e3:.3f} ms "
                                             f"predicted, {measured[kind] * 1e3:.3f} measured)" for kind in PASSES))
    return contexts


def fit_runs(runs: list[RunEvidence], gpu: str) -> dict[str, float]:
    """Each pass's median over the runs' fits: repeated runs of one shape on one host differ in the forward's
    Python pace (BENCHMARKS.md, 2026-12-05 seventh), so one run is one draw of it."""
    fits = []
    for ev in runs:
        try:
            fits.append(fit(ev, gpu))
        except Refused as exc:
            raise Refused(f"{ev.run_dir}: {exc}") from None
    return {kind: median(f[kind] for f in fits) for kind in PASSES}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", required=True, choices=("H200", "H100"))
    ap.add_argument("--run", required=True, type=Path, nargs="+", help="the file's calibration runs (with timers)")
    ap.add_argument("--write", action="store_true", help="store them in the file's host block")
    args = ap.parse_args(argv)
    runs = []
    for run in args.run:
        try:
            runs.append(read_run(run))
        except UserError as exc:
            print(f"host_contexts.py: --run {run}: {exc}", file=sys.stderr)
            return 2
    try:
        contexts = fit_runs(runs, args.gpu)
    except Refused as exc:
        print(f"host_contexts.py: --run {exc}", file=sys.stderr)
        return 2
    print("; ".join(f"{kind} context {contexts[kind]:.3f} (the median)" for kind in PASSES))
    if args.write:
        path = hardware_file(args.gpu)
        data = json.loads(path.read_text())
        data["host"]["engine_contexts"] = {
            "source": f"fitted by `python3 runs/bench/host_contexts.py --gpu {args.gpu} --run "
                      f"{' '.join(map(str, args.run))} --write` on the calibration runs' forward and backward timer "
                      f"ranges (means over each run's unprofiled steady steps; the median of the runs' fits)",
            **{k: round(v, 3) for k, v in contexts.items()}}
        write_hardware_json(path, data)
        print(f"wrote host.engine_contexts of {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
