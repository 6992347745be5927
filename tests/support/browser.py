"""The dashboard served and a headless browser to read it: `train-ledger dashboard` on a free port of 127.0.0.1, and
Debian's Chromium (/usr/bin/chromium, or $CHROMIUM) driven by Playwright as a driver only (no `playwright install`,
no downloaded browser). Importing this module skips the importing test module, saying why, where either is missing.
Every wait is bounded and the server is always terminated (its process group: the command execs Streamlit)."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Iterator

import pytest

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SERVER_START_S = 90
PAGE_S = 60

if not (Path(CHROMIUM).is_file() or shutil.which("chromium")):
    pytest.skip(f"Chromium not found at {CHROMIUM} (install the Debian packages chromium and chromium-driver)",
                allow_module_level=True)
playwright = pytest.importorskip("playwright.sync_api", reason="the playwright Python package drives Chromium")
pytest.importorskip("streamlit")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc: subprocess.Popen, port: int, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the dashboard exited with {proc.returncode}:\n{log.read_text()}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/_stcore/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.5)
    pytest.fail(f"the dashboard did not answer within {SERVER_START_S}s:\n{log.read_text()}")


@contextlib.contextmanager
def dashboard_server(runs_root: Path, log: Path) -> Iterator[str]:
    """`train-ledger dashboard` over runs_root on a free port, healthy, its URL; stopped (its whole process group)
    on exit."""
    port = free_port()
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "cli.main", "dashboard", "--runs-root", str(runs_root),
                                 "--port", str(port)], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_healthy(proc, port, log)
        assert f"http://127.0.0.1:{port}" in log.read_text()  # bound to localhost unless told otherwise
        yield f"http://127.0.0.1:{port}/"
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=15)


def settle(tab) -> None:
    """Wait until the script run is over: the status widget ("Running...") gone, then the DOM quiet a moment."""
    tab.wait_for_selector('[data-testid="stStatusWidget"]', state="detached", timeout=PAGE_S * 1000)
    tab.wait_for_timeout(1500)
    tab.wait_for_selector('[data-testid="stStatusWidget"]', state="detached", timeout=PAGE_S * 1000)
