"""RUN/ledger/report.md and a self-contained report.html (inline CSS and SVG, no external assets: it opens offline
and survives being mailed around), both rendered from one ledger.present.report_view.View."""
from __future__ import annotations

from pathlib import Path

from common.run_dir import LEDGER_DIR, atomic_write_text
from ledger.present.report_html import render_html
from ledger.present.report_md import render_markdown
from ledger.present.report_view import build
from ledger.reconcile.run import TraceWork


def write(run_dir: str, out: Path | None = None, work: TraceWork = TraceWork()) -> tuple[Path, Path]:
    """report.md and report.html into `out` (default RUN/ledger); `work`: how the reconciliation reads traces when
    `reconcile` has not written one."""
    view = build(run_dir, work)
    out = out if out is not None else Path(run_dir) / LEDGER_DIR
    md, page = out / "report.md", out / "report.html"
    markdown, html_text = render_markdown(view), render_html(view)
    atomic_write_text(md, markdown)
    atomic_write_text(page, html_text)
    return md, page
