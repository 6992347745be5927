"""`train-ledger report RUN [--out DIR] [--workers N] [--hta-ranks RANKS] [--replay-ranks RANKS]`: report.md and a
self-contained report.html in RUN/ledger (or --out). The reconciliation is RUN/ledger/reconciliation.json when
`reconcile` wrote it, else computed now, reading traces with --workers processes, cross-checking --hta-ranks with HTA
and replaying --replay-ranks."""
from __future__ import annotations

from cli.args import CommandParser, add_trace_flags, ledger_output_dir, trace_work


def main(argv: list[str]) -> int:
    from ledger.present.report import write

    p = CommandParser("report")
    p.add_argument("run", metavar="RUN")
    p.add_argument("--out", metavar="DIR", help="write the report here instead of RUN/ledger")
    add_trace_flags(p)
    a = p.parse_args(argv)
    md, page = write(a.run, ledger_output_dir(a.run, a.out), trace_work(a, "report"))
    print(f"wrote {md} and {page} (open the .html in any browser; it needs no network)")
    return 0
