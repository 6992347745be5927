"""The argparse flavour every command uses: errors raise ConfigError (one line, exit 2) instead of exiting."""
from __future__ import annotations

import argparse
from pathlib import Path

from common.errors import ConfigError, InputError
from common.run_dir import LEDGER_DIR, check_writable


class CommandParser(argparse.ArgumentParser):
    def __init__(self, command: str, **kwargs):
        super().__init__(prog=f"train-ledger {command}", allow_abbrev=False, **kwargs)

    def error(self, message: str) -> None:
        raise ConfigError(message)


def help_wanted(argv: list[str]) -> bool:
    return "-h" in argv or "--help" in argv


def print_help(command: argparse.ArgumentParser, flags: argparse.ArgumentParser) -> None:
    """The help of a command that takes Megatron's flags beside its own (train, simulate, search): its own usage and
    options, then the Megatron flags it passes on, without a second usage block."""
    command.print_help()
    groups = flags.format_help().split("\n\n")[1:]  # after the usage block
    groups = [g for g in groups if not g.startswith("options:")]  # only -h, which the command's help already is
    print("\nMegatron flags (model, batch, parallelism, ...):\n\n" + "\n\n".join(groups), end="")


def ledger_output_dir(run: str, out: str | None) -> Path:
    """The folder `reconcile` / `report` write into: --out, else RUN/ledger; checked before any work so that a
    read-only run directory is one line that offers --out, not a traceback after the reconciliation."""
    if not Path(run).is_dir():
        raise InputError(run, "not a directory")
    folder = Path(out) if out is not None else Path(run) / LEDGER_DIR
    try:
        check_writable(folder / ".write-check")
    except InputError as exc:
        hint = "" if out is not None else "; pass --out DIR to write it elsewhere"
        raise InputError(folder, f"cannot write the ledger output here ({exc.problem}){hint}") from None
    return folder


def add_trace_flags(p: CommandParser, hta: bool = True) -> None:
    """--workers (processes reading traces) and, for the commands that reconcile, --hta-ranks."""
    p.add_argument("--workers", type=_workers, metavar="N",
                   help="processes that read traces (default $TRAIN_LEDGER_WORKERS, else one per core, at most one "
                        "per trace)")
    if hta:
        p.add_argument("--hta-ranks", default="ends", metavar="RANKS",
                       help="traced GPU ranks the HolisticTraceAnalysis cross-check runs on: ends (the first and the "
                            "last, default), all, none, or ranks like 0,3,8-15")


def _workers(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of worker processes, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a number of worker processes (1 or more), got {n}")
    return n
