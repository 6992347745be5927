"""The scripts under runs/bench/ as modules, for tests of their reading and their refusals (they are not a package)."""
from __future__ import annotations

import importlib.util
import types
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "runs" / "bench"


def bench_script(name: str) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
