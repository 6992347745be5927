"""Fixtures shared by several test files, each computed once per session: what they hold is an expensive real run
that more than one file reads (a module-scoped fixture would run it again for every file that uses it).

The suite runs on pytest-xdist workers (pyproject.toml: `-n auto --dist loadgroup`; auto is one more than the cores,
`pytest_xdist_auto_num_workers`), each with its own session: a
test file whose tests share a module-scoped fixture stays on one worker, and so do all the files that share one of
these session runs, so that no run is made twice; every other test goes wherever a worker is free."""
from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

import pytest

from tests.support.training_runs import train, train_and_resume


@pytest.fixture(scope="session")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """Two gloo runs (tests/support/training_runs.py), the second resuming the first's checkpoint (first, second),
    side by side under a runs root of their own. Tests must not write into them: they copy what they change."""
    return train_and_resume(tmp_path_factory.mktemp("resumed_runs"))


@pytest.fixture(scope="session")
def cp2_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A gloo CP2 run of the tiny model with timers and both start-up sweeps (its own sweep cache, so the compute
    sweep runs rather than reading this machine's), read by tests/test_context_parallel.py (ring volume) and
    tests/test_cp_overlap.py (hidden fraction, time predictions). Tests must not write into it."""
    root = tmp_path_factory.mktemp("cp2")
    return train(root / "run", "--nproc-per-node", "2", "--model", "tiny", "--context-parallel-size", "2",
                  "--global-batch-size", "2", "--micro-batch-size", "1", "--train-iters", "3", "--timers",
                  "--bandwidth-sweep", "--compute-sweep", env={"XDG_CACHE_HOME": str(root / "cache")})


EP2_FLAGS = ("--model", "tiny", "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
             "--global-batch-size", "4", "--micro-batch-size", "1")


@pytest.fixture(scope="session")
def ep2_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A gloo EP2 run of the tiny MoE model (EP2_FLAGS) with timers and both start-up sweeps (its own sweep cache),
    read by tests/test_moe_calibration.py (all-to-all sweep and time, expert groups) and tests/test_moe_time_model.py
    (the step replay). Tests must not write into it."""
    root = tmp_path_factory.mktemp("ep2")
    return train(root / "run", "--nproc-per-node", "2", *EP2_FLAGS, "--train-iters", "4", "--timers",
                  "--bandwidth-sweep", "--compute-sweep", env={"XDG_CACHE_HOME": str(root / "cache")})


@pytest.hookimpl(tryfirst=True)  # before xdist's own hook reads the marks
def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test file that shares a fixture beyond one test with its xdist group: the session run of ours it
    uses (the first by name, should it use two: the other would only be made twice), else the file itself when it has
    a module-scoped fixture. Files that share nothing get no group."""
    shared: dict[str, set[str]] = defaultdict(set)  # file -> what its tests share
    for item in items:
        file = item.nodeid.split("::")[0]
        for defs in item._fixtureinfo.name2fixturedefs.values():
            for d in defs:
                if d.scope == "session" and d.func.__module__.startswith("tests."):
                    shared[file].add(f"session:{d.argname}")
                elif d.scope in ("module", "package", "class"):
                    shared[file].add(file)
    for item in items:
        names = sorted(shared.get(item.nodeid.split("::")[0], ()), key=lambda n: (not n.startswith("session:"), n))
        if names:
            item.add_marker(pytest.mark.xdist_group(names[0]))


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """One worker more than cores: the multi-rank tests spend part of their time waiting (process start, rendezvous,
    a launcher's signal), which the spare worker fills (whole suite on 2 cores: 12:41 with two workers, 11:53 with
    three)."""
    return len(os.sched_getaffinity(0)) + 1
