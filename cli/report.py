"""`train-ledger report RUN [--out DIR]`: report.md and a self-contained report.html in RUN/ledger (or --out)."""
from __future__ import annotations

from cli.args import CommandParser, ledger_output_dir


def main(argv: list[str]) -> int:
    from ledger.present.report import write

    p = CommandParser("report")
    p.add_argument("run", metavar="RUN")
    p.add_argument("--out", metavar="DIR", help="write the report here instead of RUN/ledger")
    a = p.parse_args(argv)
    md, page = write(a.run, ledger_output_dir(a.run, a.out))
    print(f"wrote {md} and {page} (open the .html in any browser; it needs no network)")
    return 0
