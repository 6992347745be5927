"""Fit a GPU's hardware file's efficiency curves from kernel timings (our real runs' compute sweeps and the grid
sweeps of runs/bench/hardware_sweep.py), then check the file against real runs' measured step times.

    python3 runs/bench/hardware_fit.py [--gpu H200|H100] [--write] [--runs RUN ...] [--sweeps SWEEP.json.gz ...]

1. Fit (ledger/models/simulate/fit.py): the `compute` events of the runs (for the H200 by default the committed real
   H200 runs, tests/fixtures/h200_llama1b/* and tests/fixtures/h200_2layer_profiled) and the records of --sweeps,
   each timed on that GPU, give the GEMM cost form (fixed + FLOPs / (peak e_c) + output bytes / (HBM bw
   e_epilogue)), flash attention's efficiency by pass, head dim and sequence length, each memory-bound kernel's
   fraction of HBM bandwidth and the sustained-clock line. Only kernel records: no step time is an input. Printed
   with every record's residual.
2. --write stores the fitted blocks, with their sources and this command, in the GPU's file
   (ledger/models/hardware/<gpu>.json); an H200 fit also goes, labelled as an assumption, into the A100 files (their
   datasheet figures untouched), which no sweep has measured.
3. Check: for each run, predict_step(cfg, hardware_calibration(cfg, load_hardware(GPU))) against the run's measured
   step time (median of its steady steps, as reconcile's throughput.step_time) and against the time model
   calibrated on the run's own sweep (ledger.reconcile.time_rows.predict_run).
"""
from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import shlex
import sys
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from ledger.evidence.run import collect_run  # noqa: E402
from ledger.evidence.steps import select_steps  # noqa: E402
from ledger.models.simulate import hardware_calibration, load_hardware  # noqa: E402
from ledger.models.simulate.fit import HardwareFit, fit_hardware  # noqa: E402
from ledger.models.simulate.hardware import HARDWARE_DIR, hardware_file, write_hardware_json  # noqa: E402
from ledger.models.time_model import predict_step  # noqa: E402
from ledger.reconcile.time_rows import predict_run  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"
# The runs each GPU's fit checks by default: for the H200 the runs its first fit took records from; for the H100 the
# runs of runs/bench/new_shapes.py's two H100 sets (BENCHMARKS.md, 2026-12-05 seventh)
RUNS = {"H200": [FIXTURES / "h200_llama1b" / n for n in ("s4096", "s8192", "s8192-selective", "s8192-full",
                                                          "8b-4layers", "s16384", "s2048-mbs4",
                                                          "8b-8layers-s8192-selective")]
                + [FIXTURES / "h200_2layer_profiled"],
        "H100": sorted(run for name in ("h100_new_shapes", "h100_second_shapes")
                       for run in (FIXTURES / name).glob("*/"))}
DERIVED = ("a100-80gb.json", "a100-40gb.json")  # the H200 fit, as an assumption: no sweep of an A100
SIGNIFICANT = 4


def rel(path: Path) -> str:
    return str(path.resolve().relative_to(ROOT)) if path.resolve().is_relative_to(ROOT) else str(path)


class SweepRefused(ValueError):
    """A --sweeps file this fit cannot take: unreadable, not a sweep, or timed on another device than the GPU's."""


def compute_records(runs: list[Path], sweeps: list[Path] = (), gpu: str = "H200") -> list[dict]:
    """The runs' `compute` events, and the records of grid sweeps (runs/bench/hardware_sweep.py output), each sweep
    timed on `gpu` (a sweep of another device, a CPU's among them, would bend its curves)."""
    found = [dataclasses.asdict(r) for run in runs for rank in collect_run(run).ranks.values() for r in rank.compute]
    for sweep in sweeps:
        opener = gzip.open if sweep.suffix == ".gz" else open
        try:
            with opener(sweep, "rt") as f:
                data = json.load(f)
            device, records = data["device"], data["records"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SweepRefused(f"{sweep}: not a readable sweep file ({exc.__class__.__name__}: {exc})") from None
        if gpu not in str(device):
            raise SweepRefused(f"{sweep}: timed on {device!r}, not an {gpu}")
        found += records
    return found


def rounded(x):
    if isinstance(x, float):
        return float(f"{x:.{SIGNIFICANT}g}")
    if isinstance(x, dict):
        return {k: rounded(v) for k, v in x.items()}
    if isinstance(x, list):
        return [rounded(v) for v in x]
    return x


def blocks(fit: HardwareFit, source: str) -> dict[str, dict]:
    measured = "; ".join(f"{p} head_dim {d}: seq {', '.join(map(str, s))}"
                         for p, by in fit.attention_measured.items() for d, s in sorted(by.items()))
    return {
        "gemm": {"source": f"{source}: seconds = fixed_s + max(flops / (peak x compute_efficiency), operand bytes "
                           f"/ (HBM bandwidth x the residual add's efficiency)) + output bytes / (HBM bandwidth x "
                           f"epilogue_efficiency), least squares on relative error over {fit.counts['gemm']} GEMM "
                           f"records ({fit.counts['gemm_streamed']} of them bound by their operands' streaming, left "
                           f"out; epilogue_efficiency > 1: part of the output traffic stays in L2)",
                 **rounded(fit.gemm)},
        "attention": {"source": f"{source}: flops / (peak x seconds) of SDPA flash attention per pass, head dim and "
                                f"seq as a curve over batch x heads, measured at {measured}",
                      **{p: {"by_head_dim": {str(d): {str(seq): rounded(pts) for seq, pts in by_seq.items()}
                                             for d, by_seq in by.items()}}
                         for p, by in fit.attention.items()}},
        "memory_bound": {"source": f"{source}: seconds = fixed_s + bytes moved (ledger/models/simulate/kernel_cost.py "
                                   f"bytes_moved) / (HBM bandwidth x efficiency), one fixed_s, one efficiency per "
                                   f"kernel over {fit.counts['memory_bound']} records (an MoE routing pass: its own "
                                   f"fixed_s too, fixed_s_by_kernel, with fixed_s >= 0 and efficiency <= 1); "
                                   f"optimizer.step, "
                                   f"optimizer.step_foreach and grad_buffer.zero: bytes per element / (HBM bandwidth "
                                   f"x seconds per element); default: the median engine kernel's (Megatron-LM's "
                                   f"unfused chains left out)", **rounded(fit.memory)},
        "sustained": {"source": f"{source}: {fit.counts['sustained']} sustained.layer records (a layer's kernels "
                                f"back to back at the power limit): their slowdown at full load (the record's time "
                                f"over the same kernels' isolated time) = 1 + slope x (layer isolated efficiency - "
                                f"threshold_efficiency), a line through them",
                      **rounded(fit.sustained)},
    }


def write(fit: HardwareFit, command: str, fitted_from: str, gpu: str) -> None:
    path = hardware_file(gpu)
    fitted = json.loads(path.read_text())
    source = f"fitted by `{command}` from {fitted_from} (kernel records only)"
    fitted.update(blocks(fit, source))
    write_hardware_json(path, fitted)
    for name in DERIVED if gpu == "H200" else ():
        other_path = HARDWARE_DIR / name
        other = json.loads(other_path.read_text())
        assumption = (f"assumption: the H200 fit (ledger/models/hardware/h200.json, version {fitted['version']}) "
                      "unchanged, "
                      f"as fractions of this GPU's own peak and HBM bandwidth (every kernel time scales with them); "
                      f"no compute sweep of the {other['name']}. The H200 fit")
        other.update(blocks(fit, assumption))
        write_hardware_json(other_path, other)


def measured_step(run: Path) -> tuple[float, int]:
    ev = collect_run(run)
    records = [s for r in ev.ranks.values() for s in r.steps if s.step_time_s]
    selection = select_steps(ev.config, ev.world_size, records)
    steady = set(selection.steady(s.step for s in records))
    times = [s.step_time_s for s in records if s.step in steady]
    return median(times), len(times)


def print_fit(fit: HardwareFit) -> None:
    print("GEMM:", {k: f"{v:.4g}" for k, v in fit.gemm.items()})
    for p, by in fit.attention.items():
        for d, by_seq in sorted(by.items()):
            for seq, pts in sorted(by_seq.items()):
                print(f"attention {p} head_dim {d} seq {seq}:",
                      ", ".join(f"b x heads {x:.0f}: {e:.3f}" for x, e in pts))
    memory = fit.memory
    print(f"memory-bound: fixed {memory['fixed_s'] * 1e6:.2f} us, default {memory['default_efficiency']:.3f};",
          ", ".join(f"{k} {v:.3f}" for k, v in memory["efficiency_by_kernel"].items()))
    print("sustained:", {k: f"{v:.4g}" for k, v in fit.sustained.items()})
    errors = [(p - t) / t for _, _, t, p in fit.residuals]
    print(f"\nresiduals (fitted vs measured isolated seconds), {len(errors)} records: "
          f"rms {100 * (sum(e * e for e in errors) / len(errors)) ** 0.5:.1f}%, "
          f"max {100 * max(map(abs, errors)):.1f}%")
    print("| kind | kernel | measured us | fitted us | error |\n|---|---|---|---|---|")
    for kind, name, t, p in fit.residuals:
        print(f"| {kind} | {name} | {t * 1e6:.1f} | {p * 1e6:.1f} | {100 * (p - t) / t:+.1f}% |")


def check(runs: list[Path], gpu: str) -> None:
    hw = load_hardware(gpu)
    print(f"\nstep time, predicted vs measured (error = (predicted - measured) / measured); hardware file "
          f"{rel(Path(hw.path))} version {hw.version}")
    print(f"| run | measured s (steady steps) | own sweep predicted s | error | {gpu} file predicted s | error | "
          "sustained |\n|---|---|---|---|---|---|---|")
    for run in runs:
        cfg = collect_run(run).config
        measured, n = measured_step(run)
        own = predict_run(collect_run(run)).step.step_time
        cal = hardware_calibration(cfg, hw)
        predicted = predict_step(cfg, cal).step_time
        print(f"| {rel(run)} | {measured:.4f} ({n}) | {own:.4f} | {100 * (own - measured) / measured:+.1f}% | "
              f"{predicted:.4f} | {100 * (predicted - measured) / measured:+.1f}% | {cal.sustained:.3f} |")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", choices=sorted(RUNS), default="H200", help="the GPU whose file is fitted (default H200)")
    ap.add_argument("--runs", nargs="+", type=Path, help="real run directories of that GPU to fit and check "
                                                         "(default: RUNS of the GPU)")
    ap.add_argument("--sweeps", nargs="*", type=Path, default=[],
                    help="grid sweeps (runs/bench/hardware_sweep.py --out) fitted with the runs' records")
    ap.add_argument("--sweeps-only", action="store_true",
                    help="fit from the grid sweeps alone: the runs are then only checked, never fitted")
    ap.add_argument("--write", action="store_true", help="store the fit in ledger/models/hardware/*.json")
    args = ap.parse_args(argv)
    default_runs = args.runs is None
    args.runs = RUNS[args.gpu] if default_runs else args.runs
    command = "python3 runs/bench/hardware_fit.py" + (f" --gpu {args.gpu}" if args.gpu != "H200" else "") + (
        " --write" if args.write else "") + (
        "" if default_runs else " --runs " + " ".join(shlex.quote(rel(r)) for r in args.runs)) + (
        " --sweeps " + " ".join(shlex.quote(rel(s)) for s in args.sweeps) if args.sweeps else "") + (
        " --sweeps-only" if args.sweeps_only else "")
    print(f"command: {command}\nruns: {', '.join(rel(r) for r in args.runs)}\n")
    hw_file = json.loads(hardware_file(args.gpu).read_text())
    if args.sweeps_only and not args.sweeps:
        ap.error("--sweeps-only needs --sweeps")
    try:
        records = compute_records([] if args.sweeps_only else args.runs, args.sweeps, args.gpu)
    except SweepRefused as exc:
        print(f"hardware_fit: {exc}", file=sys.stderr)
        return 2
    fit = fit_hardware(records, peak=hw_file["peak_flops"]["bf16"]["value"],
                       hbm_bandwidth=hw_file["hbm_bandwidth"]["value"])
    print_fit(fit)
    if args.write:
        fitted_from = " and ".join(
            ([f"the compute sweeps of real {args.gpu} runs"] if not args.sweeps_only else [])
            + ([f"the grid sweep of runs/bench/hardware_sweep.py on one {args.gpu} (no training run)"]
               if args.sweeps else []))
        write(fit, command, fitted_from, args.gpu)
        print(f"\nwrote the fit into {rel(hardware_file(args.gpu))}"
              + (f" and, as an assumption, {', '.join(DERIVED)}" if args.gpu == "H200" else ""))
    check(args.runs, args.gpu)
    return 0


if __name__ == "__main__":
    sys.exit(main())
