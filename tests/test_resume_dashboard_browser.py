"""The Runs page of a resumed run in headless Chromium (tests/support/browser.py's server and browser): the loss
curve is drawn over iterations 1..6 with the marker "resumed from iteration 3". The runs are
tests/test_resume_dashboard.py's, made once per session (the fixture `resumed`, tests/conftest.py)."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.browser import CHROMIUM, CHROMIUM_ARGS, PAGE_S, dashboard_server, playwright, settle


@pytest.mark.slow
def test_the_runs_page_draws_the_joined_curve_and_the_marker_in_chromium(resumed: tuple[Path, Path],
                                                                          tmp_path: Path) -> None:
    runs_root = resumed[1].parent
    with dashboard_server(runs_root, tmp_path / "server.log") as url, playwright.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(str(tmp_path / "profile"), executable_path=CHROMIUM,
                                                       headless=True, args=CHROMIUM_ARGS,
                                                       viewport={"width": 1400, "height": 1400})
        try:
            tab = context.new_page()
            tab.set_default_timeout(PAGE_S * 1000)
            tab.goto(f"{url}?run=second")
            settle(tab)
            tab.wait_for_selector(".js-plotly-plot .main-svg")
            assert tab.locator('[data-testid="stException"]').count() == 0
            marker = tab.locator(".js-plotly-plot .annotation-text", has_text="resumed from iteration 3")
            assert marker.count() == 1
            points = tab.locator(".js-plotly-plot .scatterlayer .point")
            assert points.count() == 6  # iterations 1..3 of run first, 4..6 of run second, one line
            tab.screenshot(path=str(tmp_path / "resumed-runs-page.png"), full_page=True)
        finally:
            context.close()
