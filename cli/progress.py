"""Progress lines on stderr for the commands that work for tens of seconds (export-trace, buffer).

Shown only where a person watches: when stderr is a terminal, never with --json and never on stdout, so a pipe or
a script sees exactly what it saw before. TRAIN_LEDGER_PROGRESS=1 forces them on (a terminal that is not detected as
one, a test), =0 off. Plain lines rather than a redrawn bar: the core package depends on neither tqdm nor rich (rich
comes only with the dashboard extra), and a line per stage reads the same in a terminal and in a log.
"""
from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager
from typing import Iterator

from common.errors import ConfigError

ENV = "TRAIN_LEDGER_PROGRESS"


def progress_wanted(json_output: bool = False) -> bool:
    if json_output:
        return False
    forced = os.environ.get(ENV)
    if forced is None or forced == "":
        return sys.stderr.isatty()
    if forced not in ("0", "1"):
        raise ConfigError(f"{ENV}={forced!r}: expected 1 (progress on stderr) or 0 (none)")
    return forced == "1"


class Progress:
    """`progress("reading trace 1/8")` prints "export-trace: reading trace 1/8 [0.0 s]" on stderr when enabled."""

    def __init__(self, command: str, enabled: bool):
        self.command, self.enabled, self.t0 = command, enabled, time.monotonic()

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"{self.command}: {message} [{time.monotonic() - self.t0:.1f} s]", file=sys.stderr, flush=True)

    @contextmanager
    def waiting(self, message: str, every_s: float = 5.0) -> Iterator[None]:
        """One line now and one every `every_s` seconds until the block ends: work with no stages of its own to
        report (a subprocess) still shows it is alive."""
        self(message)
        if not self.enabled:
            yield
            return
        done = threading.Event()
        ticker = threading.Thread(target=self._tick, args=(message, every_s, done), daemon=True)
        ticker.start()
        try:
            yield
        finally:
            done.set()
            ticker.join()

    def _tick(self, message: str, every_s: float, done: threading.Event) -> None:
        while not done.wait(every_s):
            self(f"{message} (still running)")
