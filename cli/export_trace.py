"""`train-ledger export-trace RUN --out FILE.json.gz [--steps A-B] [--ranks ...] [--workers N]`: one Perfetto trace
for the run, its ranks read and written by --workers processes."""
from __future__ import annotations

from cli.args import CommandParser, add_trace_flags
from cli.progress import Progress, progress_wanted
from common.errors import ConfigError


def main(argv: list[str]) -> int:
    from ledger.evidence.rank_sets import parse_ranks
    from ledger.evidence.read import read_run
    from ledger.present.trace_export import alignment_lines, export, parse_steps

    p = CommandParser("export-trace")
    p.add_argument("run", metavar="RUN")
    p.add_argument("--out", required=True, help="FILE.json.gz (or .json)")
    p.add_argument("--steps", help="A-B: only these ProfilerSteps")
    p.add_argument("--ranks", nargs="+", help="ranks to include: 0 1 4-7 or 0,1,4-7")
    add_trace_flags(p, reconciles=False)
    a = p.parse_args(argv)
    if not a.out.endswith((".json.gz", ".json")):
        raise ConfigError(f"--out {a.out}: name a .json.gz (or .json) file; the merged trace is JSON, which Perfetto "
                          "and chrome://tracing open by that name")
    steps, ranks = parse_steps(a.steps), parse_ranks(a.ranks)
    progress = Progress("export-trace", progress_wanted())
    result = export(read_run(a.run), a.out, steps, ranks, progress=progress, workers=a.workers)
    print(f"wrote {result.out}: {result.events:,} events from ranks {result.ranks}")
    print("\n".join(alignment_lines(result)))
    print("open it at https://ui.perfetto.dev (Open trace file) or chrome://tracing")
    return 0
