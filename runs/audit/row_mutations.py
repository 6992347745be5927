"""The mutation audit of the ledger's rows: break each judged row's predictor and see which test notices.

    python3 runs/audit/row_mutations.py [--metrics METRIC ...] [--tests PATH ...] [--slow] [--workers N]

For each metric (default: every metric that a reconciliation of the committed run directories under tests/fixtures
judges ok, warn or off), pytest runs the tests with that row judged "ok" whatever it measures
(runs/audit/mutate_rows.py: a row judged against a reference gets its own measurement as prediction; a threshold row
never reaches its limits), stopping at the first failure. A row no test fails for is one whose predictor could
return the measurement it is judged against, or whose tolerance could grow without bound, and the suite would pass:
it needs a test that corrupts its measurement and expects "off" (tests/test_recorded_rows_go_off.py). "never built"
means no test built a row of the metric. The default tests are the fast ones (`-m "not slow"`); one metric takes
seconds when a test catches it early and the whole run (minutes) when none does. Prints a table and the exact
command.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from common.errors import UserError  # noqa: E402
from ledger.evidence.megatron.ingest import is_megatron_run  # noqa: E402
from ledger.models.simulate.hardware import load_hardware  # noqa: E402
from ledger.reconcile.hta import HtaChoice  # noqa: E402
from ledger.reconcile.run import TimeSources, TraceWork, reconcile  # noqa: E402

FIXTURES = REPO / "tests" / "fixtures"
JUDGED = ("ok", "warn", "off")


def recorded_runs() -> list[Path]:
    """Every committed run directory: ours (a manifest) and Megatron-LM's."""
    ours = {p.parent for p in FIXTURES.rglob("manifest.json")}
    megatron = {p for p in FIXTURES.rglob("*") if p.is_dir() and is_megatron_run(p) and not is_megatron_run(p.parent)}
    return sorted(ours | megatron)


def judged_metrics(runs: list[Path]) -> list[str]:
    """The metrics some row of these runs' reconciliations judges (Megatron-LM's priced from the H200 file)."""
    found: set[str] = set()
    for run in runs:
        sources = TimeSources(hardware=load_hardware("H200")) if is_megatron_run(run) else TimeSources()
        try:
            result = reconcile(run, TraceWork(hta=HtaChoice.parse("none")), sources)
        except UserError as exc:  # a run the reader refuses (an old fixture kept for one reader test)
            print(f"skipped {run.relative_to(REPO)}: {exc}", file=sys.stderr)
            continue
        found |= {r.metric for r in result.rows if r.verdict in JUDGED}
    return sorted(found)


def audit(metric: str, tests: list[str], slow: bool, workers: int) -> tuple[str, float]:
    """(what caught the mutation of `metric`: the first failing test, "NOT CAUGHT" or "never built", seconds)."""
    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "applied"
        env = dict(os.environ, MUTATE_METRIC=metric, MUTATE_ROWS_LOG=str(log),
                   PYTHONPATH=os.pathsep.join([str(REPO / "runs" / "audit"), os.environ.get("PYTHONPATH", "")]))
        argv = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "mutate_rows", "-p", "no:cacheprovider",
                "-n", str(workers), *([] if slow else ["-m", "not slow"]), *tests]
        start = time.perf_counter()
        done = subprocess.run(argv, cwd=REPO, env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        failed = [line.removeprefix("FAILED ").split(" - ")[0] for line in done.stdout.splitlines()
                  if line.startswith("FAILED ")]
        if failed:
            return failed[0].split("@")[0], seconds  # pytest-xdist's "@<group>" suffix
        if done.returncode not in (0, 5):
            return f"pytest exit {done.returncode}: {done.stdout.strip().splitlines()[-1:]}", seconds
        return ("NOT CAUGHT" if log.exists() else "never built"), seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--metrics", nargs="+", help="the rows to mutate (default: every metric the fixtures judge)")
    ap.add_argument("--tests", nargs="+", default=["tests"], help="what pytest runs (default: tests)")
    ap.add_argument("--slow", action="store_true", help="the multi-rank tests too")
    ap.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (default 2)")
    a = ap.parse_args()
    if a.workers < 1:
        ap.error(f"--workers must be at least 1, got {a.workers}")
    metrics = a.metrics or judged_metrics(recorded_runs())
    print("| metric | the first test that failed | s |")
    print("|---|---|---|")
    uncaught = 0
    for metric in metrics:
        caught, seconds = audit(metric, a.tests, a.slow, a.workers)
        uncaught += caught == "NOT CAUGHT"
        print(f"| {metric} | {caught} | {seconds:.0f} |", flush=True)
    print(f"{len(metrics)} metric(s), {uncaught} not caught")
    print("command: python3 runs/audit/row_mutations.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
