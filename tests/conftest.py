"""Fixtures shared by several test files, each computed once per session: what they hold is an expensive real run
that more than one file reads (a module-scoped fixture would run it again for every file that uses it)."""
from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def resumed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """tests/test_resume_dashboard.py's two gloo runs, the second resuming the first's checkpoint (first, second),
    side by side under a runs root of their own. Tests must not write into them: they copy what they change."""
    from tests.test_resume_dashboard import train_and_resume

    return train_and_resume(tmp_path_factory.mktemp("resumed_runs"))
