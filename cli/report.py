"""`train-ledger report RUN [--out DIR] [--workers N] [--hta-ranks RANKS]`: report.md and a self-contained
report.html in RUN/ledger (or --out). The reconciliation is RUN/ledger/reconciliation.json when `reconcile` wrote
it, else computed now, reading traces with --workers processes and cross-checking --hta-ranks with HTA."""
from __future__ import annotations

from cli.args import CommandParser, add_trace_flags, ledger_output_dir
from cli.progress import Progress, progress_wanted


def main(argv: list[str]) -> int:
    from ledger.present.report import write
    from ledger.reconcile.hta import HtaChoice
    from ledger.reconcile.run import TraceWork

    p = CommandParser("report")
    p.add_argument("run", metavar="RUN")
    p.add_argument("--out", metavar="DIR", help="write the report here instead of RUN/ledger")
    add_trace_flags(p)
    a = p.parse_args(argv)
    work = TraceWork(a.workers, HtaChoice.parse(a.hta_ranks), Progress("report", progress_wanted()))
    md, page = write(a.run, ledger_output_dir(a.run, a.out), work)
    print(f"wrote {md} and {page} (open the .html in any browser; it needs no network)")
    return 0
