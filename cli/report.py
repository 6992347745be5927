"""`train-ledger report RUN [--out DIR] [--workers N] [--hta-ranks RANKS] [--replay-ranks RANKS] [--calibration FILE]
[--hardware H]`: report.md and a self-contained report.html in RUN/ledger (or --out). The reconciliation is
RUN/ledger/reconciliation.json when `reconcile` wrote it, else computed now, reading traces with --workers processes,
cross-checking --hta-ranks with HTA and replaying --replay-ranks; with --calibration or --hardware (a run without
sweeps of its own: Megatron-LM's) it is always computed now, priced from them as `reconcile` prices it."""
from __future__ import annotations

from cli.args import CommandParser, add_time_source_flags, add_trace_flags, ledger_output_dir, time_sources, trace_work


def main(argv: list[str]) -> int:
    from ledger.present.report import write

    p = CommandParser("report")
    p.add_argument("run", metavar="RUN")
    p.add_argument("--out", metavar="DIR", help="write the report here instead of RUN/ledger")
    add_time_source_flags(p)
    add_trace_flags(p)
    a = p.parse_args(argv)
    out, sources = ledger_output_dir(a.run, a.out), time_sources(a)
    md, page = write(a.run, out, trace_work(a, "report"), sources)
    print(f"wrote {md} and {page} (open the .html in any browser; it needs no network)")
    return 0
