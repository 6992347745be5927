"""The layers of docs/architecture.md hold: import-linter's contracts (pyproject.toml) pass on the code, a forbidden
import makes them fail, and the ledger, the bottom layer and the dashboard's data loaders import without torch."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "probes", "engine", "ledger", "dashboard", "cli")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    """`lint-imports` over the packages under `root`, with root's pyproject.toml (root first on the import path)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([sys.executable, "-c", "from importlinter.cli import lint_imports_command; "
                           "lint_imports_command()", "--no-cache"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=120)


def test_the_contracts_pass():
    pytest.importorskip("importlinter")
    done = lint_imports(REPO)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "6 kept, 0 broken" in done.stdout


@pytest.mark.parametrize("module,line,contract", [
    ("ledger/models/plan.py", "import engine.parallel_state", "the ledger reads run directories"),
    ("ledger/models/plan.py", "import torch", "the ledger reads run directories"),
    ("engine/training.py", "import ledger.models.plan", "cli > dashboard > engine | ledger"),
    ("common/config/run_config.py", "import probes.run_dir", "cli > dashboard > engine | ledger"),
    ("dashboard/state.py", "import cli.main", "the dashboard uses the ledger"),
    ("ledger/evidence/run.py", "import ledger.reconcile.rows", "ledger, by job"),
    ("ledger/models/plan.py", "import ledger.present.units", "ledger, by job"),
    ("ledger/reconcile/rows.py", "import ledger.present.units", "ledger, by job"),
    ("engine/model_builder.py", "def later():\n    import engine.training", "no import circle"),
    ("ledger/present/report_view.py", "import ledger.present.report", "no import circle"),
])
def test_a_forbidden_import_breaks_a_contract(tmp_path: Path, module: str, line: str, contract: str):
    pytest.importorskip("importlinter")
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    with open(tmp_path / module, "a", encoding="utf-8") as f:
        f.write(f"\n{line}  # the forbidden import\n")
    done = lint_imports(tmp_path)
    assert done.returncode != 0, done.stdout
    assert f"{contract}" in done.stdout and "BROKEN" in done.stdout, done.stdout


def test_the_ledger_and_the_bottom_layer_import_without_torch():
    """Every module of ledger/ and common/ (and the dashboard's loaders) imported in a fresh interpreter: torch is
    never loaded, whatever an import pulls in at run time (the contracts see only this project's import lines)."""
    modules = [".".join(p.relative_to(REPO).with_suffix("").parts) for package in ("ledger", "common")
               for p in sorted((REPO / package).rglob("*.py")) if p.name != "__init__.py"]
    code = ("import importlib, sys\n"
            f"for m in {modules!r}: importlib.import_module(m)\n"
            "assert 'torch' not in sys.modules, sorted(m for m in sys.modules if m.startswith('torch'))\n"
            "print(len(sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_no_test_module_imports_another():
    """A helper more than one test module needs lives in tests/support/ (named for what it is), not in a test module
    that others import: running one test file must not collect another's fixtures and tests."""
    found = {}
    for path in sorted((REPO / "tests").glob("test_*.py")):
        text = path.read_text(encoding="utf-8")
        hits = re.findall(r"(?:from|import)\s+tests\.(test_\w+)", text)
        if hits:
            found[path.name] = hits
    assert found == {}
