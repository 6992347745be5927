"""report.md and report.html: verdict tables, memory waterfall, pipeline timeline, bucket overlap, offline."""
from __future__ import annotations

import re

import pytest

from cli.main import main as cli
from ledger import loaders
from tests.fixtures.synthetic_run import Spec, make_run


def test_report_files(tmp_path):
    run, _ = make_run(tmp_path / "run", Spec(peak_error=0.3))
    assert cli(["reconcile", str(run)]) == 0
    assert cli(["report", str(run)]) == 0
    md = (run / "ledger/report.md").read_text()
    page = (run / "ledger/report.html").read_text()
    assert "| memory.peak_allocated | rank 0 stage 0 |" in md and "**warn**" in md
    for heading in ("Memory waterfall per rank", "Pipeline timeline", "DP bucket overlap", "Communication volume"):
        assert heading in page
    assert page.count("<svg") == 3
    assert not re.search(r"""(src|href)=['"]?https?:""", page)  # self-contained: no external assets
    assert "nsys profile" in page


def test_loaders_feed_the_dashboard(tmp_path):
    run, known = make_run(tmp_path / "runs" / "a")
    listed = loaders.list_runs(str(tmp_path / "runs"))
    assert [r["run_id"] for r in listed] == ["synthetic-0001"] and listed[0]["reconciled"] is False
    timeline = loaders.stage_timeline(str(run))
    assert {s["step"] for s in timeline} == {3}
    assert max(s["end"] for s in timeline) == pytest.approx(known["span"])
    buckets = loaders.bucket_intervals(str(run))
    assert {(b["op"], b["bucket"]) for b in buckets} == {("reduce_scatter", 0), ("reduce_scatter", 1),
                                                         ("all_gather", 0)}
    waterfall = loaders.memory_waterfall(str(run))
    rank0 = waterfall[0]
    assert rank0["nvml_used"] == known["memory"][0]["nvml"]
    assert sum(t["measured"] for t in rank0["terms"]) == rank0["nvml_used"]
    topo = loaders.topology(str(run))
    assert topo["groups"]["pp"] == [[0, 2], [1, 3]] and topo["ranks"][3]["label"] == "rank 3 (tp0 dp1 pp1)"
    timeline_mem = loaders.memory_timeline(str(run))
    assert len(timeline_mem) == 4 * 3 and all(m["nvml_used"] for m in timeline_mem)
