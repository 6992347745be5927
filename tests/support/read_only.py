"""A folder on a file system that refuses writes, for the tests of unwritable outputs (a read-only run directory,
a read-only mount for --run-dir, --output-prefix or --save). Root ignores permission bits, so as root the folder is a
tmpfs remounted read-only (the test is skipped where mounting is not allowed); otherwise its write bits are cleared."""
from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Callable, Iterator

import pytest


@contextlib.contextmanager
def read_only_folder(where: Path, fill: Callable[[Path], None] = lambda _: None) -> Iterator[Path]:
    """`where`/ro, filled by `fill` while still writable, then read-only until the block ends."""
    mount = where / "ro"
    mount.mkdir()
    if os.geteuid() != 0:
        fill(mount)
        paths = [mount, *mount.rglob("*")]
        for path in paths:
            path.chmod(path.stat().st_mode & ~0o222)
        try:
            yield mount
        finally:
            for path in paths:
                path.chmod(path.stat().st_mode | 0o200)
        return
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("as root a read-only file system is needed, and mount is not allowed here")
    try:
        fill(mount)
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True, capture_output=True)
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)
