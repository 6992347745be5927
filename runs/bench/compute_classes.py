"""Each committed profiled GPU run's device compute by class (the rows step.device_compute.<class>, docs/formulas.md
"Device compute by class"): measured in its first profiled step against the time model's twin, with the sweep's
power-limit factor the twin's GEMMs and attention carry. No device needed: the committed fixtures.

    python runs/bench/compute_classes.py [RUN ...]
"""
from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.ops.compute_class import CLASSES  # noqa: E402
from ledger.evidence.read import read_run  # noqa: E402
from ledger.reconcile.run import reconcile_evidence  # noqa: E402
from ledger.reconcile.step_decomposition import CLASS_METRIC, class_of  # noqa: E402
from ledger.reconcile.time_rows import predict_run  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"


def gpu_traced_runs() -> list[Path]:
    """The committed run directories with a profiler trace of a CUDA rank (this engine's: traces/ beside ranks/)."""
    return sorted(p.parent for p in FIXTURES.rglob("traces") if (p.parent / "ranks").is_dir()
                  and any(p.glob("*.json.gz")) and '"type": "cuda"' in (p.parent / "manifest.json").read_text())


def cell(measured: float, predicted: float | None) -> str:
    if predicted is None:
        return f"{measured * 1e3:.1f} ms / —"
    return f"{measured * 1e3:.1f} / {predicted * 1e3:.1f} ms ({(measured / predicted - 1) * 100:+.1f}%)"


def main() -> None:
    runs = [Path(r) for r in sys.argv[1:]] or gpu_traced_runs()
    print("| run | step | " + " | ".join(f"{c}: measured / model" for c in CLASSES) + " | power-limit factor |")
    print("|---|---|" + "---|" * (len(CLASSES) + 1))
    for run in runs:
        ev = read_run(run)
        result = reconcile_evidence(ev)
        rows = [r for r in result.rows if r.metric.startswith(CLASS_METRIC)]
        if not rows:
            print(f"| {run.relative_to(ROOT)} | — | no class rows: {'; '.join(result.missing) or 'no trace'} |")
            continue
        first = min(r.step for r in rows)
        by = {class_of(r.metric): r for r in rows if r.step == first and r.rank == min(x.rank for x in rows)}
        calibration = predict_run(ev).calibration
        factor = calibration.sustained if calibration is not None else None
        print(f"| {run.relative_to(FIXTURES)} | {first} | "
              + " | ".join(cell(by[c].measured, by[c].predicted) for c in CLASSES)
              + f" | {'—' if factor is None else f'x{factor:.3f}'} |")
    print(f"command: python3 runs/bench/compute_classes.py{''.join(' ' + a for a in sys.argv[1:])}")


if __name__ == "__main__":
    main()
