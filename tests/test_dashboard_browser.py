"""The dashboard in a real browser: `train-ledger dashboard` on a free port of 127.0.0.1, headless Chromium (the
Debian package, /usr/bin/chromium) driven by Playwright as a driver only (no `playwright install`, no downloaded
browser). Every page is visited through the sidebar, for the complete run and a broken one, with no Streamlit
exception element allowed; at a 1400 px wide window nothing on a page runs past its right edge or scrolls sideways
(a table that does hides its right-hand columns), and no page asks anything of the network (the dashboard must work
offline: Streamlit's page icons came from fonts.gstatic.com); screenshots land in the test's tmp dir. Every wait is
bounded and the server is always terminated (its process group, since the command execs Streamlit in place).
"""
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

from tests.fixtures.dashboard.runs import COMPLETE, make_runs_root

CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]
PAGES = ["Runs", "Reconciliation", "Memory", "Pipeline", "Overlap", "Topology", "Traces", "What if"]
CHARTED = {"Memory", "Pipeline", "Overlap", "Topology"}  # pages whose Plotly figures must draw
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


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("browser")
    make_runs_root(tmp / "runs")
    with dashboard_server(tmp / "runs", tmp / "server.log") as url:
        yield url


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


@pytest.fixture(scope="module")
def page(server: str, tmp_path_factory: pytest.TempPathFactory):
    profile = tmp_path_factory.mktemp("chromium-profile")
    with playwright.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(str(profile), executable_path=CHROMIUM, headless=True,
                                                       args=CHROMIUM_ARGS, viewport={"width": 1400, "height": 1000})
        try:
            tab = context.new_page()
            tab.set_default_timeout(PAGE_S * 1000)
            tab.requests_elsewhere = []  # every request that is not to the dashboard's own server
            tab.on("request", lambda r: None if r.url.startswith((server, "data:", "blob:"))
                   else tab.requests_elsewhere.append(r.url))
            tab.goto(server)
            yield tab
        finally:
            context.close()


# Elements of the page's main column that stick out past the window's right edge, or scroll sideways inside it
# (a data grid wider than its box); tiny inline boxes (an icon's span) are no table.
OVERFLOW_JS = """() => {
    const width = document.documentElement.clientWidth, out = [];
    for (const el of document.querySelectorAll('[data-testid="stMain"] *')) {
        const box = el.getBoundingClientRect();
        const scrolls = el.clientWidth > 40 && el.scrollWidth > el.clientWidth + 2
            && getComputedStyle(el).overflowX !== 'visible';
        if ((box.width > 0 && box.right > width + 1) || scrolls)
            out.push(`${el.tagName}.${el.className} right ${Math.round(box.right)} `
                     + `scroll ${el.scrollWidth}/${el.clientWidth}`);
    }
    return out;
}"""


def settle(tab) -> None:
    """Wait until the script run is over: the status widget ("Running...") gone, then the DOM quiet a moment."""
    tab.wait_for_selector('[data-testid="stStatusWidget"]', state="detached", timeout=PAGE_S * 1000)
    tab.wait_for_timeout(1500)
    tab.wait_for_selector('[data-testid="stStatusWidget"]', state="detached", timeout=PAGE_S * 1000)


def visit(tab, title: str) -> None:
    tab.locator('[data-testid="stSidebarNavLink"]', has_text=title).click()
    tab.wait_for_selector(f'h1:has-text("{title}")')
    settle(tab)


def choose_run(tab, run: str) -> None:
    tab.locator('[data-testid="stSidebar"] [data-testid="stSelectbox"]').click()
    tab.get_by_role("option", name=run, exact=False).first.click()
    settle(tab)


@pytest.mark.parametrize("run", [COMPLETE, "cpu"])
def test_every_page_renders_in_chromium_within_1400_px_and_offline(page, tmp_path: Path, run: str) -> None:
    settle(page)
    choose_run(page, run)
    for title in PAGES:
        visit(page, title)
        assert page.locator('[data-testid="stException"]').count() == 0, title
        assert page.locator('[data-testid="stAlertContentError"]').count() == 0, title
        if title in CHARTED and run == COMPLETE:
            page.wait_for_selector(".js-plotly-plot .main-svg")
        assert page.evaluate(OVERFLOW_JS) == [], title
        page.screenshot(path=str(tmp_path / f"{run}-{title.lower().replace(' ', '-')}.png"), full_page=True)
    assert page.requests_elsewhere == []
    assert page.get_by_text("Deploy", exact=True).count() == 0  # Streamlit's developer toolbar is not shown


def test_a_broken_run_shows_its_error_not_a_crash(page, tmp_path: Path) -> None:
    choose_run(page, "corrupt-manifest")
    for title in PAGES[1:]:
        visit(page, title)
        assert page.locator('[data-testid="stException"]').count() == 0, title
        assert page.locator('[data-testid="stAlertContentError"]').count() >= 1, title  # the selector is real
        assert page.get_by_text("corrupt JSON").count() >= 1, title
    page.screenshot(path=str(tmp_path / "corrupt-manifest-traces.png"), full_page=True)


def test_the_selected_run_follows_across_pages(page) -> None:
    choose_run(page, "cpu")
    visit(page, "Topology")
    assert page.get_by_text("world 4 = TP2 x DP2 x PP1").count() == 1
    visit(page, "Memory")
    assert page.locator('[data-testid="stException"]').count() == 0
