"""`train-ledger ARGV` in this process, as a test reads it: the exit status and what it printed on stdout and
stderr; and `train` refused before any rank starts, as a user runs it (a subprocess)."""
from __future__ import annotations

import contextlib
import io
import subprocess
import sys
from pathlib import Path

from cli import main as cli


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(argv)
    return status, out.getvalue(), err.getvalue()


def train_refusal(tmp_path: Path, flags: list[str]) -> list[str]:
    """`train-ledger train --model tiny FLAGS` run as a user runs it: it must exit 2 and leave no run directory;
    returns what it printed on stderr, line by line."""
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "cli", "train", "--model", "tiny", *flags, "--train-iters", "1",
                           "--run-dir", str(run_dir)], capture_output=True, text=True)
    assert done.returncode == 2 and not run_dir.exists()
    return done.stderr.strip().splitlines()
