"""export-trace: one process per rank named by its coordinates, skew removed by aligning collective ends."""
from __future__ import annotations

import gzip
import json

import pytest

from cli.main import main as cli
from ledger.evidence.rank_sets import parse_ranks
from ledger.evidence.read import read_run
from ledger.evidence.traces import summarize
from ledger.present.trace_export import clock_offsets, export, index
from tests.fixtures.synthetic_run import Spec, make_run

SKEW = {1: 250.0, 2: -1000.0, 3: 40.0}


@pytest.fixture(scope="module")
def skewed(tmp_path_factory):
    run, _ = make_run(tmp_path_factory.mktemp("skew") / "run", Spec(skew_us=SKEW))
    return run


def load(path):
    return json.loads(gzip.decompress(path.read_bytes()))


def test_offsets_undo_the_skew(skewed):
    indexes = {r: index(summarize(next(skewed.glob(f"traces/rank{r}.*")))) for r in range(4)}
    alignment = clock_offsets(indexes)
    assert alignment.uncorrected == []
    for rank in range(4):
        assert alignment.offsets[rank] == pytest.approx(-SKEW.get(rank, 0.0))


def test_merged_trace_layout(skewed, tmp_path):
    out = tmp_path / "merged.json.gz"
    assert cli(["export-trace", str(skewed), "--out", str(out)]) == 0
    data = load(out)
    events = data["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    assert names == {0: "rank 0 (tp0 dp0 pp0)", 1: "rank 1 (tp0 dp1 pp0)", 2: "rank 2 (tp0 dp0 pp1)",
                     3: "rank 3 (tp0 dp1 pp1)"}
    threads = {(e["pid"], e["args"]["name"]) for e in events if e.get("name") == "thread_name"}
    assert (2, "GPU 0 stream 20") in threads and (2, "python main") in threads
    # after correction the grad-norm all-reduce ends at one instant on both members of each PP group
    ends = {}
    for e in events:
        if e.get("args", {}).get("Collective name") == "allreduce":
            ends.setdefault(e["pid"], []).append(e["ts"] + e["dur"])
    for a, b in ((0, 2), (1, 3)):
        assert ends[a] == pytest.approx(ends[b])
    counters = [e for e in events if e.get("ph") == "C" and e["pid"] == 1]
    assert {c["name"] for c in counters} == {"memory (bytes)", "nvml used (bytes)"} and len(counters) == 6
    assert data["otherData"]["clock_offsets_us"]["2"] == pytest.approx(1000.0)


def test_steps_and_ranks_select(skewed, tmp_path):
    out = tmp_path / "part.json.gz"
    result = export(read_run(skewed), out, steps=(2, 2), ranks=parse_ranks(["0,2"]))
    events = load(out)["traceEvents"]
    assert result.ranks == [0, 2] and {e["pid"] for e in events} == {0, 2}
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep")}
    assert steps == {"ProfilerStep#2"}


def test_rank_without_shared_collectives_is_reported(skewed, tmp_path):
    result = export(read_run(skewed), tmp_path / "two.json", ranks={0, 3})
    assert result.uncorrected == [0, 3]
    assert json.loads((tmp_path / "two.json").read_text())["traceEvents"]


def test_bad_selection_is_a_one_line_error(skewed, tmp_path, capsys):
    assert cli(["export-trace", str(skewed), "--out", str(tmp_path / "x.json.gz"), "--steps", "9-12"]) == 2
    assert "no trace holds those steps" in capsys.readouterr().err
    assert cli(["export-trace", str(skewed), "--out", str(tmp_path / "x.json.gz"), "--ranks", "a"]) == 2


def test_streaming_reader_matches_json_load_across_chunk_boundaries(tmp_path):
    from ledger.evidence.traces import TraceStream

    events = [{"ph": "X", "cat": "kernel", "name": f"k{i}", "ts": 1234567.891 + i, "dur": 0.5 + i % 7,
               "pid": 0, "tid": 7} for i in range(40_000)]  # about 3.5 MB: several 1 MiB refills
    doc = {"schemaVersion": 1, "distributedInfo": {"rank": 3, "world_size": 4}, "traceEvents": events,
           "trainLedger": {"run_id": "r"}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(doc, indent=1))
    stream = TraceStream(path)
    assert list(stream) == events
    assert stream.meta == {"schemaVersion": 1, "distributedInfo": {"rank": 3, "world_size": 4},
                           "trainLedger": {"run_id": "r"}}
