"""Real runs started as a user starts them (`train-ledger train` in a subprocess), for the session fixtures that
several test files read (tests/conftest.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

# The resumed pair: a tiny model on 2 gloo ranks, saving every 3 of 6 iterations.
RESUME_FLAGS = ("--nproc-per-node", "2", "--model", "tiny", "--num-layers", "2", "--micro-batch-size", "1",
                "--mock-data", "--global-batch-size", "4", "--train-iters", "6", "--save-interval", "3")


def train(run: Path, *flags: str, env: dict[str, str] | None = None) -> Path:
    """`train-ledger train FLAGS --run-dir RUN` in a subprocess, asserting it succeeded."""
    done = subprocess.run([sys.executable, "-m", "cli.main", "train", *flags, "--run-dir", str(run)],
                          capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stderr[-3000:]
    return run


def train_and_resume(root: Path) -> tuple[Path, Path]:
    """root/first stops at iteration 3 of 6 (saving with --async-save into root/ckpt, as a preempted job does);
    root/second resumes it with --load into a run directory of its own and trains 4..6."""
    first, second, ckpt = root / "first", root / "second", root / "ckpt"
    train(first, *RESUME_FLAGS, "--save", str(ckpt), "--exit-interval", "3", "--async-save")
    train(second, *RESUME_FLAGS, "--save", str(ckpt), "--load", str(ckpt))
    return first, second
