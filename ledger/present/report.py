"""RUN/ledger/report.md and a self-contained report.html (inline CSS and SVG, no external assets: it opens offline
and survives being mailed around), both rendered from one ledger.present.report_view.View."""
from __future__ import annotations

from pathlib import Path

from common.run_dir import LEDGER_DIR, atomic_write_text
from ledger.present.loaders import RunView, open_run
from ledger.present.report_html import render_html
from ledger.present.report_md import render_markdown
from ledger.present.report_view import build
from ledger.reconcile.run import TraceWork
from ledger.reconcile.time_rows import TimeSources


def write(run: str | Path | RunView, out: Path | None = None, work: TraceWork = TraceWork(),
          sources: TimeSources | None = None) -> tuple[Path, Path]:
    """report.md and report.html into `out` (default RUN/ledger), from the run read once; `work`: how the
    reconciliation reads traces when `reconcile` has not written one; `sources`: prices beyond the run's own sweeps
    (then the reconciliation is computed with them)."""
    run = run if isinstance(run, RunView) else open_run(run, work, sources)
    view = build(run)
    out = out if out is not None else run.run_dir / LEDGER_DIR
    md, page = out / "report.md", out / "report.html"
    markdown, html_text = render_markdown(view), render_html(view)
    atomic_write_text(md, markdown)
    atomic_write_text(page, html_text)
    return md, page
