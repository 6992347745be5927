"""`train-ledger report RUN`: RUN/ledger/report.md and a self-contained RUN/ledger/report.html."""
from __future__ import annotations

from cli.args import CommandParser


def main(argv: list[str]) -> int:
    from ledger.report import write

    p = CommandParser("report")
    p.add_argument("run", metavar="RUN")
    a = p.parse_args(argv)
    md, page = write(a.run)
    print(f"wrote {md} and {page} (open the .html in any browser; it needs no network)")
    return 0
