"""report.md and report.html as a person reads them: one line per figure across ranks (the CSV keeps every rank),
each caveat stated once, what is off first with its explanation, one formatter for every figure, and charts with
labelled axes, a caption, and a sentence when there is nothing to draw.

Synthetic runs (tests/fixtures/synthetic_run.py) test the plumbing; the rules every figure obeys (no 'None', no
exponent notation) are checked on recorded runs too (tests/fixtures/gloo_pp2, gpu_h200_llama1b_l2).
"""
from __future__ import annotations

import csv
import html
import re
import shutil
from pathlib import Path

import pytest

from cli.main import main as cli
from ledger.present import loaders
from ledger.reconcile.oversubscribed import NOT_JUDGED
from ledger.reconcile.rows import NOT_ON_CPU
from tests.fixtures.synthetic_run import Spec, make_run

FIXTURES = Path(__file__).parent / "fixtures"
UNREADABLE = re.compile(r"\bNone\b|\bnan\b|\d\.?\d*e[+-]\d")  # what no figure a person reads may look like


def reported(run: Path) -> tuple[str, str]:
    assert cli(["reconcile", str(run)]) == 0
    assert cli(["report", str(run)]) == 0
    return (run / "ledger/report.md").read_text(), (run / "ledger/report.html").read_text()


def table_lines(md: str, metric: str) -> list[str]:
    return [line for line in md.splitlines() if line.startswith(f"| {metric} |")]


def figures(page: str) -> list[str]:
    return re.findall(r"<figure>.*?</figure>", page, flags=re.S)


def test_report_files(tmp_path):
    run, _ = make_run(tmp_path / "run", Spec(peak_error=0.1))
    md, page = reported(run)
    (peak,) = table_lines(md, "memory.peak_allocated")  # 4 ranks, one line
    assert "| ranks 0–3 · events |" in peak and "**warn" in peak
    for heading in ("Memory per rank", "Pipeline timeline", "DP bucket overlap", "Communication volume"):
        assert heading in page
    assert page.count("<svg") == 3
    assert not re.search(r"""(src|href)=['"]?https?:""", page)  # self-contained: no external assets
    assert "nsys profile" in page


def test_rows_that_agree_across_eight_ranks_are_one_line_and_the_csv_keeps_every_rank(tmp_path):
    run, _ = make_run(tmp_path / "run", Spec(tp=2, pp=1, dp=4))
    md, _ = reported(run)
    for metric in ("memory.static_after_first_step", "memory.peak_allocated", "comm.dp.reduce_scatter.bytes_per_step"):
        (line,) = table_lines(md, metric)
        assert "ranks 0–7" in line
    with open(run / "ledger/reconciliation.csv", newline="") as f:
        per_rank = [r for r in csv.DictReader(f) if r["metric"] == "memory.static_after_first_step"]
    assert sorted(int(r["rank"]) for r in per_rank) == list(range(8))
    assert all(r["predicted"].isdigit() for r in per_rank)  # the exact byte count, for programs


def test_each_caveat_is_stated_once(tmp_path):
    """A CPU run's memory rows all say they were not measured, and 8 ranks on 2 cores tag every timed row as not
    judged: each sentence appears once in report.md, cited by number."""
    run, _ = make_run(tmp_path / "run", Spec(tp=2, pp=1, dp=4, cuda=False, traces=False, cpu_cores=2))
    md, page = reported(run)
    rows = loaders.load_rows(loaders.open_run(run))
    oversubscribed = NOT_JUDGED
    assert sum(oversubscribed in r["explanation"] for r in rows) > 8 and sum(NOT_ON_CPU in r["explanation"]
                                                                            for r in rows) > 8
    for caveat in (oversubscribed, NOT_ON_CPU):
        assert md.count(caveat) == 1, caveat
        assert page.count(html.escape(caveat)) == 1, caveat
    assert re.search(r"\[\d\] \|$", table_lines(md, "memory.peak_allocated")[0])  # the line cites its note


def test_what_is_off_comes_first_with_its_explanation(tmp_path):
    run, _ = make_run(tmp_path / "run", Spec(peak_error=1.0))  # measured peak twice the prediction
    md, page = reported(run)
    off = md.split("## What is off")[1].split("\n## ")[0]
    assert md.index("## What is off") < md.index("## Memory")
    (item,) = [line for line in off.splitlines() if line.startswith("- **memory.peak_allocated**")]
    assert "ranks 0–3" in item and "worst +100%" in item and "static (params, grads, optimizer state)" in item
    assert "see What is off" in table_lines(md, "memory.peak_allocated")[0]
    assert "<div class='off'><b>memory.peak_allocated</b>" in page


def test_figures_use_one_formatter(tmp_path):
    run, _ = make_run(tmp_path / "run", Spec(tp=2, pp=2, dp=2))
    md, page = reported(run)
    assert "| pipeline bubble | 20.00% |" in md  # (p-1)/(m+p-1) with p=2, m=4, as the fixture is built
    (bubble,) = table_lines(md, "pipeline.bubble_of_wall_time")
    assert "| 20.00% |" in bubble
    (step,) = table_lines(md, "throughput.step_time")
    assert re.search(r"\| \d+(\.\d+)? ms \|", step)  # a time in the unit its magnitude calls for, unit included
    assert re.search(r"<td title='[\d,]+ B'>[\d.]+ KiB</td>", page)  # bytes rounded, the exact count on hover
    for text in (md, page):
        assert not UNREADABLE.search(text), UNREADABLE.search(text)


@pytest.mark.parametrize("fixture", ["gloo_pp2", "gpu_h200_llama1b_l2"])
def test_recorded_runs_report_no_none_and_no_exponent(tmp_path, fixture):
    """The GPU run's FLOP rows explain themselves with numbers like 9.5e+12: the report writes them out."""
    run = tmp_path / fixture
    shutil.copytree(FIXTURES / fixture, run)
    md, page = reported(run)
    for text in (md, page):
        assert not UNREADABLE.search(text), UNREADABLE.search(text)
    if fixture.startswith("gpu"):
        assert "×10¹²" in md


def test_every_chart_has_axis_titles_with_units_and_a_caption(tmp_path):
    run, _ = make_run(tmp_path / "run", Spec(tp=2, pp=2, dp=2))
    _, page = reported(run)
    charts = figures(page)
    assert len(charts) == 3
    for chart in charts:
        titles = re.findall(r"<text class='axis-title'[^>]*>([^<]+)</text>", chart)
        assert len(titles) == 2, chart[:200]
        assert re.search(r"\((B|KiB|MiB|GiB|ns|µs|ms|s)\)$", titles[0]), titles  # the x axis says its unit
        assert re.search(r"<figcaption>[^<]*[Ww]hat to look for", chart)
        assert not re.search(r"<rect [^>]*width='0(\.0)?'", chart)  # no zero-width bars


def test_an_empty_chart_says_why(tmp_path):
    """A CPU run measures no device memory: its memory chart draws the predictions and says so. A one-GPU run
    has no DP buckets: the overlap chart is a sentence."""
    cpu, _ = make_run(tmp_path / "cpu", Spec(tp=2, pp=1, dp=2, cuda=False, traces=False))
    _, page = reported(cpu)
    memory = page.split("<h2>Memory per rank</h2>")[1].split("<h2>")[0]
    assert re.search(r"Nothing measured \(note \[\d\]\): the bars are the formulas&#x27; predictions", memory)
    assert "rank 0 predicted" in memory and NOT_ON_CPU in page
    assert "rank 0 measured" not in memory

    gpu = tmp_path / "gpu"
    shutil.copytree(FIXTURES / "gpu_h200_llama1b_l2", gpu)
    _, page = reported(gpu)
    assert ("<b>DP bucket overlap: nothing to draw.</b> "
            + html.escape("no DP bucket timers in this run (buckets exist with DP > 1")) in page


def test_loaders_feed_the_dashboard(tmp_path):
    run, known = make_run(tmp_path / "runs" / "a")
    listed = loaders.list_runs(str(tmp_path / "runs"))
    view = loaders.open_run(run)
    assert [r["run_id"] for r in listed] == ["synthetic-0001"] and listed[0]["reconciled"] is False
    timeline = loaders.stage_timeline(view)
    assert {s["step"] for s in timeline} == {3}
    assert max(s["end"] for s in timeline) == pytest.approx(known["span"])
    buckets = loaders.bucket_intervals(view)
    assert {(b["op"], b["bucket"]) for b in buckets} == {("reduce_scatter", 0), ("reduce_scatter", 1),
                                                         ("all_gather", 0)}
    waterfall = loaders.memory_waterfall(view)
    rank0 = waterfall[0]
    assert rank0["nvml_used"] == known["memory"][0]["nvml"]
    assert sum(t["measured"] for t in rank0["terms"]) == rank0["nvml_used"]
    topo = loaders.topology(view)
    assert topo["groups"]["pp"] == [[0, 2], [1, 3]] and topo["ranks"][3]["label"] == "rank 3 (tp0 dp1 pp1)"
    timeline_mem = loaders.memory_timeline(view)
    assert len(timeline_mem) == 4 * 3 and all(m["nvml_used"] for m in timeline_mem)
