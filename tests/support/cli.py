"""`train-ledger ARGV` in this process, as a test reads it: the exit status and what it printed on stdout and
stderr."""
from __future__ import annotations

import contextlib
import io

from cli import main as cli


def run(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli.main(argv)
    return status, out.getvalue(), err.getvalue()
