"""A pretrain_gpt.py command line read as Megatron-LM's parser reads it, torch-free: every option's destination and
value as str() writes it (what Megatron-LM's TensorBoard text summaries hold), its defaults filled in, so that a
command line and a run's recorded arguments become a RunConfig through the same code
(ledger/evidence/megatron/arguments.py).

The parser's options come from options.json, written from Megatron-LM's own parser at a pinned commit by
runs/megatron/megatron_options.py; a flag it does not know is an error that names it. Values are kept as given, not
typed (the ledger's flag parser types them); Megatron-LM's validation (derived sizes, padded vocabulary) is not run:
the ledger's resolve derives those the same way.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from common.errors import ConfigError

OPTIONS_FILE = Path(__file__).resolve().parent / "options.json"


@dataclass(frozen=True)
class Option:
    dest: str
    nargs: int | str | None  # argparse's: None one value, 0 a switch, "?", "*", "+", or a count
    default: str
    const: str | None = None  # a switch's value


@dataclass(frozen=True)
class CommandLine:
    arguments: dict[str, str]  # every destination -> str(value), defaults included
    given: tuple[tuple[str, str], ...]  # (option as written, destination) of each option on the line, in order
    megatron_sha: str
    unknown: tuple[str, ...] = ()  # flags the table does not know (strict=False only), their values skipped


@lru_cache(maxsize=1)
def options() -> tuple[dict[str, Option], str]:
    """(option string -> Option, the Megatron-LM commit the table was read from)."""
    table = json.loads(OPTIONS_FILE.read_text(encoding="utf-8"))
    return {name: Option(**entry) for name, entry in table["options"].items()}, table["megatron_sha"]


def defaults() -> dict[str, str]:
    table, _ = options()
    return {o.dest: o.default for o in table.values()}


def _values(option: Option, flag: str, tokens: list[str], i: int) -> tuple[list[str], int]:
    """The values `flag` takes from tokens[i:], and the index after them."""
    if option.nargs == 0:
        return [], i
    if isinstance(option.nargs, int) or option.nargs is None:
        count = 1 if option.nargs is None else option.nargs
        taken = tokens[i:i + count]
        if len(taken) < count or any(t.startswith("--") for t in taken):
            raise ConfigError(f"Megatron-LM flag {flag} expects {count} value(s)")
        return taken, i + count
    end = i
    while end < len(tokens) and not tokens[end].startswith("--"):
        end += 1
    if option.nargs == "+" and end == i:
        raise ConfigError(f"Megatron-LM flag {flag} expects at least one value")
    if option.nargs == "?" and end > i + 1:
        end = i + 1
    return tokens[i:end], end


def _text(option: Option, values: list[str]) -> str:
    """The value as str() of Megatron's parsed value would write it."""
    if option.nargs == 0:
        return option.const or "True"
    if option.nargs is None or option.nargs == "?":
        return values[0] if values else (option.const or "None")
    return str(values)


def parse_command_line(tokens: list[str], strict: bool = True) -> CommandLine:
    """A pretrain_gpt.py command line (its flags, no script name) -> its arguments. ConfigError for a value missing,
    a stray value, or (strict) a flag Megatron-LM does not know; not strict, such a flag and the values after it are
    skipped and listed (a run of another Megatron-LM version is still read)."""
    table, sha = options()
    arguments, given, unknown = defaults(), [], []
    i = 0
    while i < len(tokens):
        flag, _, inline = tokens[i].partition("=")
        if not flag.startswith("--"):
            raise ConfigError(f"Megatron-LM command line: {tokens[i]!r} is no flag's value")
        option = table.get(flag)
        if option is None and not strict:
            unknown.append(flag)
            i += 1
            while i < len(tokens) and not tokens[i].startswith("--"):
                i += 1
            continue
        if option is None:
            raise ConfigError(f"{flag} is not a Megatron-LM flag (Megatron-LM {sha[:10]}'s pretrain_gpt.py)")
        if inline:
            values, i = [inline], i + 1
        else:
            values, i = _values(option, flag, tokens, i + 1)
        arguments[option.dest] = _text(option, values)
        given.append((flag, option.dest))
    return CommandLine(arguments=arguments, given=tuple(given), megatron_sha=sha, unknown=tuple(unknown))
