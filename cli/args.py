"""The argparse flavour every command uses: errors raise ConfigError (one line, exit 2) instead of exiting."""
from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from common.config import RunConfig
from common.errors import ConfigError, InputError
from common.megatron.flag_effects import FlagEffects, classify
from common.megatron.options import parse_command_line
from common.run_dir import LEDGER_DIR, check_writable

if TYPE_CHECKING:
    from ledger.reconcile.run import TraceWork
    from ledger.reconcile.time_rows import TimeSources


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


@dataclass(frozen=True)
class MegatronCommandLine:
    """A pretrain_gpt.py command line as `plan` and `simulate` take it: the config, which flags changed the
    prediction, and what the implementation assumes."""
    config: RunConfig
    effects: FlagEffects
    not_modelled: list[str]
    assumed: list[str]

    def lines(self) -> list[str]:
        """What the command line contributed, for the top of the output."""
        out = [f"Megatron-LM flags used: {' '.join(self.effects.used) or 'none'}"]
        if self.effects.not_affecting:
            out.append(f"not affecting the prediction: {' '.join(self.effects.not_affecting)}")
        named = list(self.effects.not_modelled) + self.not_modelled
        if named:
            out.append(f"not modelled (Megatron's defaults assumed): {' '.join(named)}")
        out += [f"assumed: {note}" for note in self.assumed]
        impl = self.config.implementation
        out.append(f"implementation: {impl.transformer_impl}, {impl.attention_backend} attention, "
                   f"{impl.optimizer_impl} Adam")
        return out


def megatron_command_line(text: str | list[str], world_size: int | None) -> MegatronCommandLine:
    """A Megatron-LM command line (one string, or its flags after `--`) read by Megatron's parser's options, an
    unknown flag named (ConfigError), then resolved with Megatron's semantics (ledger/evidence/megatron)."""
    from ledger.evidence.megatron.arguments import run_config_of

    tokens = shlex.split(text) if isinstance(text, str) else list(text)
    if tokens[:1] and not tokens[0].startswith("--"):
        tokens = tokens[1:]  # the script's name (pretrain_gpt.py), as a command line starts
    line = parse_command_line(tokens)
    try:
        cfg, not_modelled, assumed = run_config_of(line.arguments, world_size or 1, "--megatron-args",
                                                   source="the command line")
    except InputError as exc:
        raise ConfigError(f"--megatron-args: {exc.problem}") from None
    return MegatronCommandLine(config=cfg, effects=classify(line), not_modelled=not_modelled, assumed=assumed)
def add_trace_flags(p: CommandParser, reconciles: bool = True) -> None:
    """--workers (processes reading traces) and, for the commands that reconcile, --hta-ranks and --replay-ranks."""
    p.add_argument("--workers", type=_workers, metavar="N",
                   help="processes that read traces (default $TRAIN_LEDGER_WORKERS, else one per core, at most one "
                        "per trace)")
    if reconciles:
        p.add_argument("--hta-ranks", default="ends", metavar="RANKS",
                       help="traced GPU ranks the HolisticTraceAnalysis cross-check runs on: ends (the first and the "
                            "last, default), all, none, or ranks like 0,3,8-15")
        p.add_argument("--replay-ranks", default="ends", metavar="RANKS",
                       help="traced ranks whose execution graphs the step decomposition replays: ends (the first and "
                            "the last, default), all, none, or ranks like 0,3,8-15")


def add_time_source_flags(p: CommandParser) -> None:
    """--calibration and --hardware: the time model's prices beyond a run's own sweeps (a Megatron-LM run has none)."""
    p.add_argument("--calibration", metavar="FILE", help="a `train-ledger calibrate` file of the run's machine")
    p.add_argument("--hardware", help="price what no sweep timed from a hardware file: H200, H100, ... or a path")


def time_sources(a: argparse.Namespace) -> "TimeSources | None":
    """The TimeSources of add_time_source_flags' flags, None where neither was given."""
    from ledger.evidence.calibration_file import read_calibration
    from ledger.models.simulate.hardware import load_hardware
    from ledger.reconcile.time_rows import TimeSources

    if a.hardware is None and a.calibration is None:
        return None
    return TimeSources(hardware=load_hardware(a.hardware) if a.hardware else None,
                       calibration=read_calibration(a.calibration) if a.calibration else None)


def trace_work(a: argparse.Namespace, command: str, quiet: bool = False) -> "TraceWork":
    """The TraceWork of add_trace_flags' flags, with progress lines on a terminal unless `quiet` (--json)."""
    from cli.progress import Progress, progress_wanted
    from ledger.evidence.rank_sets import RankChoice
    from ledger.reconcile.hta import HtaChoice
    from ledger.reconcile.run import TraceWork

    return TraceWork(a.workers, HtaChoice.parse(a.hta_ranks), Progress(command, progress_wanted(quiet)),
                     RankChoice.parse(a.replay_ranks, "--replay-ranks"))


def _workers(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of worker processes, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a number of worker processes (1 or more), got {n}")
    return n
