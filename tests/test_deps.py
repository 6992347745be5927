"""Every third-party module the package imports is declared in pyproject.toml, in the dependencies or an extra: a
fresh `pip install -e '.[...]'` must bring what the code imports. The imports are read from the source (ast), so an
import inside a function, behind a guard or in a page only the dashboard loads counts too."""
from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11

ROOT = Path(__file__).resolve().parents[1]
# module -> the distribution that provides it, where the two differ; a namespace package (google) by its subpackage
DISTRIBUTION = {"pynvml": "nvidia-ml-py", "hta": "HolisticTraceAnalysis", "google.protobuf": "protobuf"}


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()  # PEP 503


def pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def package_dirs() -> list[str]:
    return [pattern.rstrip("*") for pattern in pyproject()["tool"]["setuptools"]["packages"]["find"]["include"]]


def declared() -> dict[str, str]:
    """Distribution (normalized) -> where it is declared: "dependencies" or "extra NAME"."""
    project = pyproject()["project"]
    out = {}
    for where, requirements in [("dependencies", project["dependencies"])] + [
            (f"extra {name}", reqs) for name, reqs in project["optional-dependencies"].items()]:
        for req in requirements:
            out.setdefault(normalized(re.match(r"[A-Za-z0-9._-]+", req).group()), where)
    return out


def distribution(module: str) -> str:
    """The distribution that provides `module` (a dotted import name): the longest DISTRIBUTION key it starts with,
    else its top-level name."""
    keys = [k for k in DISTRIBUTION if module == k or module.startswith(k + ".")]
    return DISTRIBUTION[max(keys, key=len)] if keys else module.split(".")[0]


def third_party_imports() -> dict[str, set[str]]:
    """Module -> the files importing it, for every absolute import that is neither stdlib nor ours: the top-level name,
    or for a namespace package in DISTRIBUTION its subpackage ("google.protobuf")."""
    ours = set(package_dirs())
    found: dict[str, set[str]] = {}
    for package in ours:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top not in sys.stdlib_module_names and top not in ours:
                        key = next((k for k in DISTRIBUTION if "." in k and (name + ".").startswith(k + ".")), top)
                        found.setdefault(key, set()).add(str(path.relative_to(ROOT)))
    return found


def test_every_third_party_import_is_declared():
    have = declared()
    missing = {module: sorted(files) for module, files in third_party_imports().items()
               if normalized(distribution(module)) not in have}
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"


def test_the_import_scan_sees_what_the_design_names():
    # the dashboard's tables and charts, the probes' NVML and NVTX: the scan must find them or it proves nothing
    imports = third_party_imports()
    assert {"pandas", "plotly", "pynvml", "nvtx", "torch", "streamlit"} <= set(imports)
    assert all(f.startswith("dashboard/") for f in imports["pandas"])


def test_each_declared_provider_is_the_distribution_installed_under_that_name():
    """Where a module is installed here, the distribution that provides it is the one the mapping names (so that
    pynvml is nvidia-ml-py's, not the deprecated `pynvml` package's)."""
    providers = packages_distributions()
    for module in third_party_imports():
        top = module.split(".")[0]
        if top in providers:
            assert normalized(distribution(module)) in {normalized(d) for d in providers[top]}, module


def test_declared_extras_put_each_import_where_it_is_used():
    have = declared()
    assert have["pandas"] == have["plotly"] == have["streamlit"] == "extra dashboard"
    assert have["nvidia-ml-py"] == have["nvtx"] == "extra gpu"
