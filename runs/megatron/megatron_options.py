"""Megatron-LM's command-line options, from its own parser: the table `plan --megatron-args` reads a pretrain_gpt.py
command line with (common/megatron/options.json).

    MEGATRON_LM=.mlm python3 runs/megatron/megatron_options.py --out common/megatron/options.json

Builds the parser pretrain_gpt.py parses with (megatron.training.arguments.add_megatron_arguments; no model-opt
arguments) and writes, per option string: its destination, how many values it takes (argparse's nargs: null for
one, 0 for a switch, "?", "*", "+" or a count), a switch's constant and the default as str() writes it (what
Megatron-LM's TensorBoard text summaries hold), with the commit of the source tree it came from. Needs the Megatron
source tree and torch; runs on CPU (runs/megatron/megatron_cpu_memory.py's stand-ins).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from megatron_cpu_memory import stand_ins  # noqa: E402  the same stand-ins that let Megatron import on CPU


def options(parser: argparse.ArgumentParser) -> dict[str, dict]:
    table = {}
    for action in parser._actions:  # noqa: SLF001 - argparse offers no public list of a parser's options
        if isinstance(action, argparse._HelpAction):  # noqa: SLF001
            continue
        nargs = 0 if action.nargs == 0 else action.nargs
        entry = {"dest": action.dest, "nargs": nargs, "default": str(action.default)}
        if nargs == 0:
            entry["const"] = str(action.const)
        for option in action.option_strings:
            table[option] = entry
    return dict(sorted(table.items()))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True)
    a = p.parse_args()
    megatron = Path(os.environ.get("MEGATRON_LM", ".mlm")).resolve()
    stand_ins()
    sys.path.insert(0, str(megatron))
    from megatron.training.arguments import add_megatron_arguments

    parser = add_megatron_arguments(argparse.ArgumentParser(allow_abbrev=False))
    sha = (megatron / "MEGATRON_SHA").read_text().strip()
    table = {"what": "Megatron-LM's pretrain_gpt.py options (runs/megatron/megatron_options.py)", "megatron_sha": sha,
             "options": options(parser)}
    found = table.pop("options")
    lines = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in found.items()]
    head = json.dumps(table)[:-1]
    Path(a.out).write_text(f'{head}, "options": {{\n' + ",\n".join(lines) + "\n}}\n")
    print(f"{a.out}: {len(found)} option strings of Megatron-LM {sha[:10]}")


if __name__ == "__main__":
    main()
