"""A corpus of broken run directories: each must give one line on stderr naming the file and the problem, exit
status 2, no traceback, and nothing (not even a temp file) left in RUN/ledger/."""
from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Callable

import pytest

from cli.main import main as cli
from tests.fixtures.synthetic_run import Spec, make_run
from tests.support.read_only import read_only_folder


def _manifest(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())


def _set_manifest(run: Path, **fields) -> None:
    m = _manifest(run)
    m.update(fields)
    (run / "manifest.json").write_text(json.dumps(m))


def _trace(run: Path, rank: int = 0) -> Path:
    return next((run / "traces").glob(f"rank{rank}.step*.json.gz"))


def _rewrite_trace(run: Path, change: Callable[[dict], None], rank: int = 0) -> None:
    path = _trace(run, rank)
    data = json.loads(gzip.decompress(path.read_bytes()))
    change(data)
    path.write_bytes(gzip.compress(json.dumps(data).encode()))


def _rewrite_trace_by_probes(run: Path, run_id: str) -> None:
    """Rewrite rank 0's trace through the probes' own writer, as a run with id `run_id` writes it: the writer and
    the ledger's reader must agree on where the run id lives."""
    from probes.profiler import write_hta_trace

    path = _trace(run)
    raw = run.parent / "raw-trace.json"
    raw.write_bytes(gzip.decompress(path.read_bytes()))
    write_hta_trace(raw, path, 0, _manifest(run)["world_size"], run_id=run_id, steps=(1, 3), window=(1, 3))


def _insert_line(run: Path, rank: int, line: str) -> None:
    path = run / f"ranks/rank{rank}/events.jsonl"
    lines = path.read_text().splitlines()
    lines.insert(3, line)
    path.write_text("\n".join(lines) + "\n")


def _megatron(run: Path, meta: dict) -> None:
    for child in ("manifest.json",):
        (run / child).unlink()
    (run / "megatron_run.json").write_text(json.dumps(meta))


CASES: dict[str, tuple[Callable[[Path], None], str, str]] = {
    # name: (break the run, file named in the message, words of the problem)
    "missing manifest": (lambda r: (r / "manifest.json").unlink(), "manifest.json", "missing manifest"),
    "truncated manifest": (lambda r: (r / "manifest.json").write_text('{"run_id": "x", "world'),
                           "manifest.json", "corrupt JSON"),
    "manifest not an object": (lambda r: (r / "manifest.json").write_text("[1, 2]"), "manifest.json",
                               "not a JSON object"),
    "unknown schema": (lambda r: _set_manifest(r, schema_version=99), "manifest.json", "schema_version"),
    "manifest without world size": (lambda r: (r / "manifest.json").write_text(json.dumps(
        {k: v for k, v in _manifest(r).items() if k != "world_size"})), "manifest.json", "world_size"),
    "manifest without config": (lambda r: (r / "manifest.json").write_text(json.dumps(
        {k: v for k, v in _manifest(r).items() if k != "config"})), "manifest.json", "lacks 'config'"),
    "a complete run whose rank 0 recorded nothing": (lambda r: (r / "ranks/rank0/events.jsonl").write_text(""),
                                                     "ranks", "rank(s) 0 wrote no events"),
    "bad status": (lambda r: _set_manifest(r, status="exploded"), "manifest.json", "status"),
    "config contradicts world size": (lambda r: _set_manifest(r, world_size=8), "manifest.json", "world"),
    "empty run": (lambda r: [p.unlink() for p in sorted(r.rglob("*")) if p.is_file() and p.name != "manifest.json"],
                  str(Path("run")), "empty run"),
    "missing ranks in a complete run": (lambda r: (r / "ranks/rank2/events.jsonl").unlink(), "ranks",
                                        "missing ranks"),
    "rank beyond world size": (lambda r: (r / "ranks/rank7").mkdir() or (r / "ranks/rank7/events.jsonl").write_text(
        '{"kind": "step", "step": 1}\n'), "rank7", "mismatched world size"),
    "corrupt line mid-file": (lambda r: _insert_line(r, 1, '{"kind": "memory", "step": '), "rank1/events.jsonl",
                              "corrupt JSON"),
    "non-event line mid-file": (lambda r: _insert_line(r, 0, "[1, 2, 3]"), "rank0/events.jsonl", "'kind'"),
    "timing without times": (lambda r: _insert_line(r, 0, '{"kind": "timing", "step": 1, "name": "x"}'),
                             "rank0/events.jsonl", "start_s"),
    "inventory without bytes": (lambda r: _insert_line(r, 0, '{"kind": "inventory", "step": null, "name": '
                                                       '"ddp.buffer0.grad_data", "tensor_kind": "grad_buffer", '
                                                       '"numel": 1024, "buckets": [{"numel": 1024}]}'),
                                "rank0/events.jsonl", "inventory record without 'bytes'"),
    "per-element compute record without numel": (lambda r: _insert_line(r, 0, '{"kind": "compute", "step": null, '
                                                                        '"op": "optimizer.step", "dims": {}, '
                                                                        '"seconds": 0.001}'),
                                                 "rank0/events.jsonl", "without a positive dims 'numel'"),
    "truncated gzip trace": (lambda r: _trace(r).write_bytes(_trace(r).read_bytes()[:300]), "rank0.step1-3.json.gz",
                             "gzip"),
    "corrupt gzip trace": (lambda r: _trace(r).write_bytes(b"\x1f\x8b" + b"\x00garbage" * 20),
                           "rank0.step1-3.json.gz", "gzip"),
    "truncated plain JSON trace": (lambda r: _trace(r).write_text('{"traceEvents": [{"ph": "X"'),
                                   "rank0.step1-3.json.gz", "truncated JSON"),
    "not a chrome trace": (lambda r: _trace(r).write_bytes(gzip.compress(b'{"events": []}')),
                           "rank0.step1-3.json.gz", "traceEvents"),
    "trace from another run": (lambda r: _rewrite_trace(r, lambda d: d["trainLedger"].update(run_id="other")),
                               "rank0.step1-3.json.gz", "another run"),
    "probes' trace from another run": (lambda r: _rewrite_trace_by_probes(r, "20260101T000000Z-0123abcd"),
                                       "rank0.step1-3.json.gz", "another run"),
    "trace with a malformed run id": (lambda r: _rewrite_trace(r, lambda d: d["trainLedger"].update(run_id=42)),
                                      "rank0.step1-3.json.gz", "not a run id"),
    "trace of another world size": (lambda r: _rewrite_trace(r, lambda d: d["distributedInfo"].update(
        world_size=16), rank=1), "rank1.step1-3.json.gz", "another run"),
    "trace of another rank": (lambda r: _rewrite_trace(r, lambda d: d["distributedInfo"].update(rank=3), rank=2),
                              "rank2.step1-3.json.gz", "rank 3"),
    "corrupt megatron metadata": (lambda r: _megatron(r, {"argv": "not a list"}), "megatron_run.json", "argv"),
    "megatron argv that cannot run": (lambda r: _megatron(r, {"argv": [
        "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
        "--max-position-embeddings", "32", "--vocab-size", "100", "--tensor-model-parallel-size", "3"],
        "world_size": 4}), "megatron_run.json", "divisible"),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_reconcile_refuses_with_one_line(tmp_path, capsys, name):
    run, _ = make_run(tmp_path / "run", Spec(steps=3))
    breaker, filename, problem = CASES[name]
    breaker(run)
    assert cli(["reconcile", str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert filename in err and problem in err, err
    assert not (run / "ledger").exists()


@pytest.mark.parametrize("command", ["reconcile", "report"])
@pytest.mark.parametrize("name", ["empty run", "truncated gzip trace", "non-event line mid-file",
                                  "rank beyond world size"])
def test_a_failed_command_creates_no_folder(tmp_path, capsys, command, name):
    """Neither RUN/ledger nor a new --out folder exists after a command that refused its run."""
    run, _ = make_run(tmp_path / "run", Spec(steps=3))
    CASES[name][0](run)
    out = tmp_path / "elsewhere" / "ledger"
    assert cli([command, str(run)]) == 2
    assert cli([command, str(run), "--out", str(out)]) == 2
    assert not (run / "ledger").exists() and not (tmp_path / "elsewhere").exists()


def test_missing_run_directory(tmp_path, capsys):
    assert cli(["reconcile", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err
    assert "nowhere" in err and "not a directory" in err


@pytest.mark.parametrize("name", ["truncated gzip trace", "trace from another run", "probes' trace from another run"])
def test_export_trace_refuses_and_leaves_no_output(tmp_path, capsys, name):
    run, _ = make_run(tmp_path / "run", Spec(steps=3))
    CASES[name][0](run)
    out = tmp_path / "merged.json.gz"
    assert cli(["export-trace", str(run), "--out", str(out)]) == 2
    assert "rank0.step1-3.json.gz" in capsys.readouterr().err
    assert list(tmp_path.glob("*merged*")) == []


# ---- a real trace whose events contradict one another ----------------------------------------------------------

PROFILED_RUN = Path(__file__).parent / "fixtures" / "h200_2layer_profiled"


def _stamp(cat: str, ts_us: float) -> Callable[[dict], None]:
    def change(data: dict) -> None:
        for e in data["traceEvents"]:
            if e.get("cat") == cat:
                e["ts"] = ts_us
    return change


@pytest.mark.parametrize("command", ["reconcile", "whatif"])
@pytest.mark.parametrize("change,problem", [
    # every kernel stamped at one instant before the run began, before its launch and its stream's order
    (_stamp("kernel", -1.0), "events out of order, the execution graph cannot be replayed"),
    # a step window with no length: its terms would be shares of nothing
    (lambda d: [e.update(dur=0) for e in d["traceEvents"] if e.get("name", "").startswith("ProfilerStep#")],
     "a step window must have a duration"),
])
def test_a_trace_whose_order_contradicts_itself_is_refused_by_name(tmp_path, capsys, command, change, problem):
    """Found by a sweep that set each field of each kind of trace event to a bad value: these raised (a cycle in the
    replay, a division by a zero-length step) where every other answered one line or ran."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(PROFILED_RUN, run)
    _rewrite_trace(run, change)
    flags = {"reconcile": ["--out", str(tmp_path / "ledger")], "whatif": ["--no-launch-gaps"]}[command]
    argv = [command, str(run), *flags]
    assert cli(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "rank0.step4-5.json.gz" in err and problem in err, err
    assert not (tmp_path / "ledger").exists()


def test_corpus_size():
    assert len(CASES) >= 15


# ---- outputs that cannot be written ------------------------------------------------------------------------------

REAL_RUN = Path(__file__).parent / "fixtures" / "gpu_h200_llama1b_l2"


@pytest.fixture
def read_only_run(tmp_path: Path):
    """A copy of a real run on a file system that refuses writes."""
    import shutil

    with read_only_folder(tmp_path, lambda mount: shutil.copytree(REAL_RUN, mount / "run")) as mount:
        yield mount / "run"


@pytest.mark.parametrize("command", ["reconcile", "report"])
def test_a_read_only_run_directory_is_one_line_offering_out(read_only_run: Path, tmp_path: Path, capsys, command):
    assert cli([command, str(read_only_run)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.strip().splitlines()
    assert f"{read_only_run / 'ledger'}: cannot write the ledger output here" in line and "--out DIR" in line, line
    out = tmp_path / "elsewhere"
    assert cli([command, str(read_only_run), "--out", str(out)]) == 0
    assert any(out.iterdir())


@pytest.mark.parametrize("out,problem", [
    ("/proc/version/merged.json.gz", "Not a directory"),  # a path under a file
    ("/proc/no-such-dir/merged.json.gz", "No such file or directory"),  # a pseudo file system
    ("/sys/merged.json.gz", "Permission denied"),
    (".", "name a .json.gz (or .json) file")])
def test_export_trace_to_an_unwritable_place_is_one_line(capsys, out, problem):
    assert cli(["export-trace", str(REAL_RUN), "--out", out]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("train-ledger export-trace: error: ") and problem in line, line


@pytest.mark.parametrize("out", ["merged.txt", "merged.json.gz.bak", "merged"])
def test_export_trace_refuses_a_name_that_is_not_json(tmp_path: Path, capsys, out):
    assert cli(["export-trace", str(REAL_RUN), "--out", str(tmp_path / out)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"--out {tmp_path / out}: name a .json.gz (or .json) file" in line, line
    assert list(tmp_path.iterdir()) == []


def test_export_trace_refuses_a_folder_of_a_json_name(tmp_path: Path, capsys):
    (tmp_path / "merged.json.gz").mkdir()
    assert cli(["export-trace", str(REAL_RUN), "--out", str(tmp_path / "merged.json.gz")]) == 2
    assert "is a directory; name a file" in capsys.readouterr().err


def test_a_reader_that_closes_the_pipe_ends_the_command_quietly():
    """`train-ledger schedule ... | head -1`: no BrokenPipeError traceback (the command dies of SIGPIPE, as cat
    does)."""
    import subprocess

    done = subprocess.run("python3 -m cli schedule --pp 4 --microbatches 4000 | head -1", shell=True,
                          capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent.parent)
    assert done.stdout == "1F1B: pp=4, microbatches=4000\n"
    assert done.stderr == ""


def test_dashboard_refuses_a_run_that_is_not_there(tmp_path: Path, capsys):
    assert cli(["dashboard", "--runs-root", str(tmp_path), "--run", "nope"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"--run 'nope': no run directory of that name under {tmp_path.resolve()}" in line


def _no_server(*_args, **_kwargs):
    raise AssertionError("the dashboard would have started")


@pytest.mark.parametrize("host,problem", [("999.1.1.1", "not an address or a known host name"),
                                          ("no-such-host.invalid", "not an address or a known host name"),
                                          ("192.0.2.1", "cannot listen there (Cannot assign requested address)")])
def test_dashboard_refuses_an_address_it_cannot_listen_on(tmp_path: Path, capsys, monkeypatch, host, problem):
    """192.0.2.1 is TEST-NET-1 (RFC 5737): a valid address that is no interface of this machine."""
    monkeypatch.setattr("os.execve", _no_server)
    assert cli(["dashboard", "--runs-root", str(tmp_path), "--host", host, "--port", "8599"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"train-ledger dashboard: error: --host {host!r}" if "known" in problem else
                           f"train-ledger dashboard: error: --host {host} --port 8599") and problem in line, line


def test_dashboard_refuses_a_port_in_use(tmp_path: Path, capsys, monkeypatch):
    import socket

    monkeypatch.setattr("os.execve", _no_server)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert cli(["dashboard", "--runs-root", str(tmp_path), "--port", str(port)]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f"--port {port}: cannot listen there (Address already in use)" in line, line


def test_a_failed_run_whose_rank_0_recorded_nothing_says_so(tmp_path, capsys):
    """A failed run is reconciled for what it wrote; an empty events file is a rank that wrote nothing."""
    run, _ = make_run(tmp_path / "run", Spec(steps=3, status="failed"))
    (run / "ranks/rank0/events.jsonl").write_text("")
    assert cli(["reconcile", str(run)]) == 0
    assert "  missing: no events for rank(s) 0 of 4\n" in capsys.readouterr().out
