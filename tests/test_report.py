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


def explanation(md: str, metric: str) -> str:
    """A table line's explanation: its last cell, or the item under the table it moved to (a long row), unwrapped."""
    (line,) = table_lines(md, metric)
    cell = line.rsplit(" | ", 1)[1].removesuffix(" |")
    if cell != "below the table":
        return cell
    item = md.split(f"\n- `{metric}` ")[1].split("\n\n")[0].split("\n- ")[0]
    return " ".join(item.split("\n  "))


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
    assert re.search(r"\[\d\]$", explanation(md, "memory.peak_allocated"))  # the line cites its note


def test_what_is_off_comes_first_with_its_explanation(tmp_path):
    run, _ = make_run(tmp_path / "run", Spec(peak_error=1.0))  # measured peak twice the prediction
    md, page = reported(run)
    off = md.split("## What is off")[1].split("\n## ")[0]
    assert md.index("## What is off") < md.index("## Memory")
    items = " ".join(off.split("\n  ")).splitlines()  # an item's wrapped lines joined
    (item,) = [line for line in items if line.startswith("- **memory.peak_allocated**")]
    assert "ranks 0–3" in item and "worst +100%" in item and "static (params, grads, optimizer state)" in item
    assert "see What is off" in table_lines(md, "memory.peak_allocated")[0]
    assert "<div class='off'><b>memory.peak_allocated</b>" in page


def test_an_off_threshold_on_a_real_run_names_no_worst_gap(tmp_path):
    """memory.other_processes is judged against a bar, not a reference (the H200 run beside a 4 GiB process): its
    item says what was measured and why it is off, with no empty 'worst' in between."""
    run = tmp_path / "cotenant"
    shutil.copytree(FIXTURES / "h200_nvml_processes/cotenant", run)
    md, page = reported(run)
    items = " ".join(md.split("## What is off")[1].split("\n## ")[0].split("\n  ")).splitlines()
    (item,) = [line for line in items if line.startswith("- **memory.other_processes**")]
    assert "measured 4.51 GiB. the most other processes held" in item
    assert "worst" not in item and "worst —" not in page


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


@pytest.mark.parametrize("fixture", ["gloo_4ranks_2cores", "gloo_dp2_overlap"])
def test_a_recorded_runs_report_reads_in_a_terminal_and_states_each_note_once(tmp_path, fixture):
    """Prose and lists wrap at 120 characters, a table row stays under 300 (a longer explanation goes under its
    table), and every numbered note's text appears once in report.md: in the Notes list, nowhere inline."""
    from ledger.present.report_md import TABLE_ROW_LIMIT, WIDTH
    from ledger.present.report_view import build

    run = tmp_path / fixture
    shutil.copytree(FIXTURES / fixture, run)
    md, _ = reported(run)
    for line in md.splitlines():
        assert len(line) <= (TABLE_ROW_LIMIT if line.startswith("|") else WIDTH) or " " not in line.strip(), line
    notes = build(loaders.open_run(run)).notes.texts
    assert notes
    flat = " ".join(md.split())  # the Notes list is wrapped: compare with whitespace runs as one space
    for text in notes:
        assert flat.count(" ".join(text.split())) == 1, text


def test_the_report_says_what_each_verdict_means_and_labels_figures_in_their_own_unit(tmp_path):
    """'identity' is explained where the counts are; the throughput headline's label does not fix a prefix its
    value may not have (a CPU run's 74 MFLOP/s is no 'TFLOP/s')."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "gloo_4ranks_2cores", run)
    md, page = reported(run)
    for text in (" ".join(md.split()), page):
        assert "identity: both sides are one quantity by construction" in text
    (flops,) = [line for line in md.splitlines() if line.startswith("| FLOP/s per GPU |")]
    assert re.search(r"\| [\d.]+ [kMGT]?FLOP/s \|", flops), flops
    assert "| mean over 1 row, measured |" in md


def test_one_nsys_command_in_the_report_the_readme_and_the_dashboard(tmp_path):
    """report.md and README give ledger.present.report_view's NSYS_COMMAND (the Traces page imports it)."""
    from ledger.present.report_view import NSYS_COMMAND

    run, _ = make_run(tmp_path / "run", Spec())
    md, page = reported(run)
    readme = (Path(__file__).parents[1] / "README.md").read_text()
    for text in (md, readme, html.unescape(page)):
        assert " ".join(NSYS_COMMAND.split()) in " ".join(text.split())
    assert len(re.findall(r"nsys profile", readme)) == 1
