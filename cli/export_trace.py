"""`train-ledger export-trace RUN --out FILE.json.gz [--steps A-B] [--ranks ...]`: one Perfetto trace for the run."""
from __future__ import annotations

from cli.args import CommandParser


def main(argv: list[str]) -> int:
    from ledger.trace_export import export, parse_ranks, parse_steps

    p = CommandParser("export-trace")
    p.add_argument("run", metavar="RUN")
    p.add_argument("--out", required=True, help="FILE.json.gz (or .json)")
    p.add_argument("--steps", help="A-B: only these ProfilerSteps")
    p.add_argument("--ranks", nargs="+", help="ranks to include: 0 1 4-7 or 0,1,4-7")
    a = p.parse_args(argv)
    result = export(a.run, a.out, parse_steps(a.steps), parse_ranks(a.ranks))
    offsets = ", ".join(f"{r}:{o:+.1f}" for r, o in sorted(result.offsets_us.items()))
    print(f"wrote {result.out}: {result.events:,} events from ranks {result.ranks}; clock offsets (µs) {offsets}"
          + (f"; not aligned (no shared collectives): {result.uncorrected}" if result.uncorrected else ""))
    print("open it at https://ui.perfetto.dev (Open trace file) or chrome://tracing")
    return 0
