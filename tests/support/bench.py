"""The scripts under runs/ (runs/bench/, runs/audit/) as modules, for tests of their reading and their refusals
(they are not a package)."""
from __future__ import annotations

import importlib.util
import types
from pathlib import Path

RUNS = Path(__file__).resolve().parents[2] / "runs"


def bench_script(name: str, folder: str = "bench") -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"{folder}_{name}", RUNS / folder / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def assert_refused(script: types.ModuleType, argv: list[str], capsys) -> None:
    """`script.main(argv)` refuses: exit 2, nothing on stdout, one line on stderr that names the script."""
    assert script.main(argv) == 2
    out, err = capsys.readouterr()
    name = Path(script.__file__).name
    assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith(f"{name}: "), (argv, err)
