"""`train-ledger`: one dispatcher, one module per command in this package.

Commands import their implementation lazily so that `train-ledger plan` never imports torch and a missing optional
dependency (streamlit, say) only affects its own command. Any UserError becomes one line on stderr and exit status 2.
"""
from __future__ import annotations

import importlib
import importlib.metadata
import signal
import sys

from common.errors import UserError

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("cli.demo", "the main job here: instrumented run -> reconcile -> report"),
    "train": ("cli.train", "train with Megatron flags (under torchrun, or --nproc-per-node N)"),
    "preprocess": ("cli.preprocess", "a .jsonl corpus -> Megatron's indexed dataset (.bin/.idx) for --data-path"),
    "groups": ("cli.groups", "the rank groups of a TP x CP x DP x PP layout"),
    "buffer": ("cli.buffer", "the 2-rank buffer / distributed-optimizer toy"),
    "schedule": ("cli.schedule", "a pipeline schedule's event order, chart and bubble"),
    "plan": ("cli.plan", "the analytic memory / comm / FLOPs plan of a configuration"),
    "simulate": ("cli.simulate", "a layout on N GPUs of a kind, predicted (or --validate against real runs)"),
    "search": ("cli.search", "the best layouts of a model on N GPUs of a kind, ranked by predicted tokens/s"),
    "calibrate": ("cli.calibrate", "this machine's compute sweep alone, as a file reconcile --calibration reads"),
    "whatif": ("cli.whatif", "a run's profiled steps replayed with kernels / communication faster, no launch gaps or "
                             "no straggler"),
    "reconcile": ("cli.reconcile", "formula vs inventory vs measurement for a run directory"),
    "report": ("cli.report", "report.md and report.html for a run directory"),
    "export-trace": ("cli.export_trace", "merge per-rank traces into one Perfetto trace"),
    "dashboard": ("cli.dashboard", "the Streamlit app over run directories"),
}


def _usage() -> str:
    lines = ["usage: train-ledger COMMAND [ARGS]   (train-ledger COMMAND --help: its flags)",
             "       train-ledger --version", "", "commands:"]
    lines += [f"  {name:<13} {help_}" for name, (_, help_) in COMMANDS.items()]
    return "\n".join(lines)


def _version() -> str:
    try:
        return f"train-ledger {importlib.metadata.version('train-ledger')}"
    except importlib.metadata.PackageNotFoundError:
        return "train-ledger (not installed: no version; pip install -e . records it)"


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(_usage())
        return 0 if argv else 2
    if argv[0] in ("-V", "--version"):
        print(_version())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"train-ledger: error: unknown command {name!r} (one of: {', '.join(COMMANDS)})", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(COMMANDS[name][0])
        return int(module.main(rest) or 0)
    except UserError as exc:
        print(f"train-ledger {name}: error: {exc}", file=sys.stderr)
        return 2
    except SystemExit as exc:  # argparse's --help: printed, and done
        return int(exc.code or 0)


def entry() -> None:
    """The `train-ledger` script. A reader that closes the pipe (`train-ledger plan ... | head -3`) ends the command
    quietly, as it ends `cat`, instead of with a BrokenPipeError traceback; every output file is written atomically,
    so nothing is left half-written."""
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main())


if __name__ == "__main__":
    entry()
