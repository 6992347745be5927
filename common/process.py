"""Process lifetime across the launcher chain `train-ledger train` -> torchrun -> ranks (Linux).

A rank must not outlive the processes that launched it: a launcher killed outright (SIGKILL, an OOM kill, a closed
terminal) cannot forward anything, so each child asks the kernel for a signal when its parent dies
(prctl PR_SET_PDEATHSIG). SIGTERM then reaches torchrun, which stops its workers, and each rank turns SIGTERM into
`Terminated` so that it records the run as failed on the way out.

A stop arrives more than once (torchrun's SIGTERM, then the kernel's when torchrun exits) and may land while the
failure is being recorded (a peer's hang-up ends a gloo call, and the pending handler fires at the next Python
call): `Terminated` is raised for the first signal only, so recording the failure a second time completes.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG = 1
_stopped_by: str | None = None


class Terminated(BaseException):
    """SIGTERM (or SIGINT) arrived: leave like an interrupt, through every `finally` and failure handler."""


def die_with_parent(parent_pid: int | None = None) -> None:
    """Have the kernel send this process SIGTERM when its parent dies; exit at once if it already has (the parent
    may die between fork and this call). A no-op where prctl does not exist."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(128 + signal.SIGTERM)


def stopped_by() -> str | None:
    """The first stop signal's name (SIGTERM, SIGINT) once one has arrived, else None."""
    return _stopped_by


def raise_on_termination() -> None:
    """Turn the first SIGTERM or SIGINT into `Terminated` in the main thread; later ones are ignored."""
    def handler(signum: int, _frame: object) -> None:
        global _stopped_by
        if _stopped_by is not None:
            return
        _stopped_by = signal.Signals(signum).name
        raise Terminated(f"stopped by {_stopped_by}")

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
