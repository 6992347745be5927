"""Megatron's dataset code, imported without megatron/core/__init__.py (which pulls in GPU-only packages): from the
installed megatron-core package (the test extra installs it, with its prebuilt C++ helpers), else from a .mlm copy of
Megatron-LM (git-ignored: present where a developer put it), whose helpers.cpp is compiled here as its Makefile
compiles it. Only its logging helper log_single_rank is stood in for; the format and sampling code is Megatron's own.
Each fixture skips, saying why, where that cannot be done."""
from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import sysconfig
import types
from contextlib import contextmanager
from pathlib import Path

import pytest


def _megatron_root() -> Path:
    """The folder holding megatron/: the installed megatron-core's, located without importing it, else .mlm."""
    try:
        from importlib.metadata import PackageNotFoundError, distribution

        root = Path(distribution("megatron-core").locate_file(""))
        if (root / "megatron/core/datasets/indexed_dataset.py").is_file():
            return root
    except PackageNotFoundError:
        pass
    return Path(__file__).resolve().parents[2] / ".mlm"


MLM = _megatron_root()
DATASETS = MLM / "megatron/core/datasets"


@contextmanager
def megatron_datasets(tmp_dir: Path, *, helpers: bool = False):
    """megatron.core.datasets as a package; with helpers=True, its helpers_cpp compiled into tmp_dir."""
    pytest.importorskip("torch")
    if not DATASETS.is_dir():
        pytest.skip(f"no megatron-core installed and no Megatron-LM copy at {MLM}")
    saved = {k: v for k, v in sys.modules.items() if k == "megatron" or k.startswith("megatron.")}
    for name, sub in (("megatron", ""), ("megatron.core", "/core"), ("megatron.core.datasets", "/core/datasets")):
        package = types.ModuleType(name)
        package.__path__ = [str(MLM / "megatron") + sub]
        sys.modules[name] = package
    utils = types.ModuleType("megatron.core.utils")
    utils.log_single_rank = lambda logger, level, message: None
    sys.modules["megatron.core.utils"] = utils
    try:
        if helpers:
            helpers_cpp = sys.modules["megatron.core.datasets.helpers_cpp"] = _compile_helpers(tmp_dir)
            sys.modules["megatron.core.datasets"].helpers_cpp = helpers_cpp
        yield sys.modules["megatron.core.datasets"]
    finally:
        for name in [k for k in sys.modules if k == "megatron" or k.startswith("megatron.")]:
            del sys.modules[name]
        sys.modules.update(saved)


def _compile_helpers(tmp_dir: Path) -> types.ModuleType:
    """megatron-core's prebuilt helpers_cpp where the package ships one for this Python, else helpers.cpp compiled."""
    prebuilt = DATASETS / f"helpers_cpp{sysconfig.get_config_var('EXT_SUFFIX')}"
    if prebuilt.is_file():
        return _load("megatron.core.datasets.helpers_cpp", prebuilt)
    pybind11 = pytest.importorskip("pybind11", reason="pybind11 is needed to compile Megatron's helpers.cpp")
    if shutil.which("g++") is None:
        pytest.skip("g++ is needed to compile Megatron's helpers.cpp")
    out = tmp_dir / f"helpers_cpp{sysconfig.get_config_var('EXT_SUFFIX')}"
    includes = [f"-I{pybind11.get_include()}", f"-I{sysconfig.get_paths()['include']}"]
    built = subprocess.run(["g++", "-O1", "-shared", "-std=c++17", "-fPIC", *includes, str(DATASETS / "helpers.cpp"),
                            "-o", str(out)], capture_output=True, text=True, timeout=300)
    if built.returncode:
        pytest.skip(f"Megatron's helpers.cpp does not compile here: {built.stderr.strip().splitlines()[-1:]}")
    return _load("megatron.core.datasets.helpers_cpp", out)


def _load(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
