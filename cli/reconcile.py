"""`train-ledger reconcile RUN [--json] [--fail-on off|warn] [--out DIR]`: formula vs inventory vs measurement.

Writes reconciliation.json and .csv into RUN/ledger (or --out DIR), atomically, after everything is computed.
--json prints the same object on stdout and nothing else. --fail-on warn|off makes the exit status 1 when any row
reaches that verdict, so a CI job can gate on the ledger; stderr then says which rows.
"""
from __future__ import annotations

import json
import sys

from cli.args import CommandParser, ledger_output_dir


def main(argv: list[str]) -> int:
    from ledger.reconcile.rows import reaches
    from ledger.reconcile.run import reconcile, write

    p = CommandParser("reconcile")
    p.add_argument("run", metavar="RUN")
    p.add_argument("--json", action="store_true")
    p.add_argument("--fail-on", choices=("off", "warn"))
    p.add_argument("--out", metavar="DIR", help="write the reconciliation here instead of RUN/ledger")
    a = p.parse_args(argv)
    out = ledger_output_dir(a.run, a.out)
    result = reconcile(a.run)
    json_path, csv_path = write(result, out)
    if a.json:
        print(json.dumps(result.to_dict(), default=str))
    else:
        print_summary(result, json_path, csv_path)
    if a.fail_on and reaches(result.rows, a.fail_on):
        failed = [r for r in result.rows if reaches([r], a.fail_on)]
        names = ", ".join(sorted({r.metric for r in failed}))
        print(f"train-ledger reconcile: {len(failed)} row(s) at or above {a.fail_on!r}: {names}", file=sys.stderr)
        return 1
    return 0


def print_summary(result, json_path, csv_path) -> None:
    run = result.run
    counts = result.verdict_counts()
    print(f"run {run['run_id']} ({run['framework']}, {run['status']}, world {run['world_size']}): "
          f"{len(result.rows)} rows: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    for r in result.rows:
        if r.verdict in ("warn", "off"):
            where = " ".join(f"{k}{getattr(r, k)}" for k in ("rank", "stage", "bucket") if getattr(r, k) is not None)
            print(f"  {r.verdict:<4} {r.metric} [{where or r.scope}] predicted {_fmt(r.predicted)} inventory "
                  f"{_fmt(r.inventory)} measured {_fmt(r.measured)} {r.unit}: {r.explanation}")
    for line in result.missing:
        print(f"  missing: {line}")
    print(f"wrote {json_path} and {csv_path}")


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:,.0f}" if abs(value) >= 100 else f"{value:.4g}"
