"""The dashboard in a real browser (tests/support/browser.py: the server on localhost, headless Chromium). Every page
is visited through the sidebar, for the complete run and a broken one, with no Streamlit exception element allowed;
screenshots land in the test's tmp dir.
"""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from tests.fixtures.dashboard.runs import COMPLETE, make_runs_root
from tests.support.browser import CHROMIUM, CHROMIUM_ARGS, PAGE_S, dashboard_server, playwright, settle

PAGES = ["Runs", "Reconciliation", "Memory", "Pipeline", "Overlap", "Topology", "Traces", "What if"]
CHARTED = {"Memory", "Pipeline", "Overlap", "Topology"}  # pages whose Plotly figures must draw


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("browser")
    make_runs_root(tmp / "runs")
    with dashboard_server(tmp / "runs", tmp / "server.log") as url:
        yield url


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


def test_the_traces_page_draws_each_steps_waterfall_without_the_network(page, tmp_path: Path) -> None:
    """The complete run's first traced rank and step: the step decomposition's waterfall, inline SVG in an iframe, a
    bar per term (ledger.present.step_waterfall), and nothing in the frame that loads from anywhere."""
    choose_run(page, COMPLETE)
    visit(page, "Traces")
    assert page.get_by_text("Where each profiled step went").count() == 1
    chart = page.frame_locator("iframe").first
    chart.locator("svg rect").first.wait_for()
    assert chart.locator("svg text", has_text="device compute").count() == 1
    assert chart.locator("svg text", has_text="step, measured: the sum").count() == 1
    assert chart.locator("svg rect").count() >= 5
    # beneath it, that step's device compute by class (ledger.present.step_table.CLASS_INTRO): a row per class
    assert page.get_by_text("Each profiled step's device compute", exact=False).count() == 1
    for cls in ("matmul", "attention", "optimizer", "other kernels"):
        assert page.get_by_text(cls, exact=True).count() >= 1, cls
    # nothing loads from elsewhere (Streamlit's own inline script sizes the frame; the chart carries none)
    assert chart.locator("link, img, iframe, [src], [href]").count() == 0
    page.screenshot(path=str(tmp_path / f"{COMPLETE}-traces-waterfall.png"), full_page=True)


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
