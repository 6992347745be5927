"""`train-ledger reconcile RUN [--json] [--fail-on off|warn] [--out DIR] [--workers N] [--hta-ranks RANKS]
[--replay-ranks RANKS] [--calibration FILE] [--hardware H]`:
formula vs inventory vs measurement.

Writes reconciliation.json and .csv into RUN/ledger (or --out DIR), atomically, after everything is computed.
--json prints the same object on stdout and nothing else. --fail-on warn|off makes the exit status 1 when any row
reaches that verdict, so a CI job can gate on the ledger; stderr then says which rows. Traces are read by --workers
processes; the HTA cross-check runs on --hta-ranks (ledger.reconcile.hta), the step decomposition's replay on
--replay-ranks. Progress goes to stderr on a terminal.
A run without its own sweeps (a Megatron-LM run) gets time predictions from --calibration FILE (`train-ledger
calibrate` on the same machine) and / or --hardware (H200, H100, A100-80GB, A100-40GB or a hardware file): the run's
own sweeps come first, then the file's, then the hardware file's prices.
"""
from __future__ import annotations

import json
import sys

from cli.args import CommandParser, add_time_source_flags, add_trace_flags, ledger_output_dir, time_sources, trace_work


def main(argv: list[str]) -> int:
    from ledger.reconcile.rows import reaches
    from ledger.reconcile.run import reconcile, write
    from ledger.reconcile.time_rows import TimeSources

    p = CommandParser("reconcile")
    p.add_argument("run", metavar="RUN")
    p.add_argument("--json", action="store_true")
    p.add_argument("--fail-on", choices=("off", "warn"))
    p.add_argument("--out", metavar="DIR", help="write the reconciliation here instead of RUN/ledger")
    add_time_source_flags(p)
    add_trace_flags(p)
    a = p.parse_args(argv)
    work = trace_work(a, "reconcile", quiet=a.json)
    out = ledger_output_dir(a.run, a.out)
    result = reconcile(a.run, work, time_sources(a) or TimeSources())
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
    """The verdict counts, then each warn / off figure once (rows that agree across ranks are one line, as in
    report.md), caveats they share as numbered notes, and what is missing."""
    from ledger.present import units
    from ledger.present.caveats import Notes
    from ledger.present.report_view import against
    from ledger.present.row_groups import group

    run = result.run
    counts = result.verdict_counts()
    print(f"run {run['run_id']} ({run['framework']}, {run['status']}, world {run['world_size']}): "
          f"{len(result.rows)} rows: " + ", ".join(f"{v} {k}" for k, v in counts.items()))
    lines = [line for line in group([r.to_dict() for r in result.rows]) if line.verdict() in ("warn", "off")]
    notes = Notes.of([line.explanation() for line in lines])
    for line in lines:
        cited = units.plain(notes.cite(line.explanation()).inline())
        print(f"  {line.verdict():<4} {line.metric} [{line.where()}] {against(line)}; worst {line.gap()}: {cited}")
    for number, text in enumerate(notes.texts, 1):
        print(f"  [{number}] {units.plain(text)}")
    for line in result.missing:
        print(f"  missing: {units.plain(line)}")
    print(f"wrote {json_path} and {csv_path}")
