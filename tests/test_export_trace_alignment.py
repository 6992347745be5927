"""export-trace says how it aligned the ranks' clocks: which collectives two ranks matched on, or why a rank could not
be aligned. The gloo cases are the recorded runs (gloo records no process group: ledger.evidence.trace_groups names
it); the skew cases are synthetic traces whose offsets are known (tests/fixtures/synthetic_run.py: plumbing)."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from cli.main import main as cli
from ledger.evidence.read import read_run
from ledger.present.trace_export import alignment_lines, export
from tests.fixtures.synthetic_run import Spec, make_run

FIXTURES = Path(__file__).parent / "fixtures"


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    run, _ = make_run(tmp_path_factory.mktemp("skew") / "run", Spec(skew_us={1: 250.0, 2: -1000.0, 3: 40.0}))
    return run


def test_each_aligned_rank_names_the_rank_and_the_collectives_it_was_aligned_on(skewed, tmp_path):
    # Spec: TP1 x DP2 x PP2, so rank 0 shares its DP group with rank 1 (the buckets' reduce-scatters and the
    # all-gather) and its PP group with rank 2 (the grad norm's all-reduce); rank 3 is reached through rank 1.
    result = export(read_run(skewed), tmp_path / "m.json.gz")
    lines = alignment_lines(result)
    assert lines[0] == "clock alignment: rank 0 is the reference (offset 0)"
    rank1, rank2, rank3 = lines[1:4]
    assert rank1.startswith("rank 1: -250.0 µs, from rank 0 over ") and "dp reduce_scatter" in rank1
    assert rank2.startswith("rank 2: +1000.0 µs, from rank 0 over 3 shared collectives (") and "all_reduce" in rank2
    assert rank3.startswith("rank 3: -40.0 µs, from rank 1 over ")
    assert len(lines) == 4


def test_ranks_that_share_no_group_say_so(skewed, tmp_path):
    result = export(read_run(skewed), tmp_path / "two.json.gz", ranks={0, 3})
    assert result.uncorrected == [0, 3]
    (line,) = [x for x in alignment_lines(result) if x.startswith("rank 3")]
    # rank 3 (dp1 pp1) is in PP group [1, 3] and DP group [2, 3]
    assert line == ("rank 3: not aligned (offset 0): no other exported rank is in the groups its collectives ran on "
                    "([1, 3], [2, 3])")


def test_a_single_traced_rank_has_nothing_to_align(tmp_path, capsys):
    """gloo_dp2_overlap traced rank 0 only. What the message says about its collectives follows from the run: DP2 is
    its only group of more than one rank, so every collective is named (ledger.evidence.trace_groups)."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "gloo_dp2_overlap", run)
    assert cli(["export-trace", str(run), "--out", str(tmp_path / "m.json.gz")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "clock alignment: nothing to align: rank 0 is the only rank with a trace" in out
    assert ("rank 0: its trace records no process group ranks (gloo's does not); the ledger named the groups of 27 of "
            "its 27 collectives (issuing range 6, worker thread 15, only group of several ranks 6)") in out


def test_a_rank_whose_collectives_nothing_names_says_why(tmp_path):
    """The recorded PP2 run with its trace copied to rank 1 (rank 1's own groups, the same run id): plumbing for the
    message when two ranks share groups but their traces cover different steps."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "gloo_pp2", run)
    (trace,) = (run / "traces").glob("rank0.*")
    later = run / "traces" / "rank1.step30-31.json.gz"
    shutil.copy(trace, later)
    _shift_steps(later, 27)
    result = export(read_run(run), tmp_path / "m.json.gz")
    (line,) = [x for x in alignment_lines(result) if x.startswith("rank 1: not aligned")]
    assert line == ("rank 1: not aligned (offset 0): it shares groups with rank 0 but no collective matched on "
                    "(group, op, ProfilerStep, order): its steps 30-32, theirs 3-5")


def _shift_steps(path: Path, by: int) -> None:
    import gzip
    import json
    import re

    doc = json.loads(gzip.decompress(path.read_bytes()))
    doc["distributedInfo"]["rank"] = 1
    for e in doc["traceEvents"]:
        m = re.match(r"^ProfilerStep#(\d+)$", str(e.get("name", "")))
        if m:
            e["name"] = f"ProfilerStep#{int(m.group(1)) + by}"
    path.write_bytes(gzip.compress(json.dumps(doc).encode()))
