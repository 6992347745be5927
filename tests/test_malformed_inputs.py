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
    ledger_dir = run / "ledger"
    assert not ledger_dir.exists() or not any(ledger_dir.iterdir())


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


def test_corpus_size():
    assert len(CASES) >= 15


# ---- outputs that cannot be written ------------------------------------------------------------------------------

REAL_RUN = Path(__file__).parent / "fixtures" / "gpu_h200_llama1b_l2"


@pytest.fixture
def read_only_run(tmp_path: Path):
    """A copy of a real run on a file system that refuses writes. Root ignores permission bits, so as root the copy
    lives on a tmpfs remounted read-only (skipped where mounting is not allowed)."""
    import os
    import shutil
    import subprocess

    mount = tmp_path / "ro"
    mount.mkdir()
    run = mount / "run"
    if os.geteuid() != 0:
        shutil.copytree(REAL_RUN, run)
        for path in [run, *run.rglob("*")]:
            path.chmod(path.stat().st_mode & ~0o222)
        yield run
        return
    if subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(mount)], capture_output=True).returncode:
        pytest.skip("as root a read-only file system is needed, and mount is not allowed here")
    try:
        shutil.copytree(REAL_RUN, run)
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True, capture_output=True)
        yield run
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


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
    (".", "is a directory")])
def test_export_trace_to_an_unwritable_place_is_one_line(capsys, out, problem):
    assert cli(["export-trace", str(REAL_RUN), "--out", out]) == 2
    captured = capsys.readouterr()
    (line,) = captured.err.strip().splitlines()
    assert line.startswith("train-ledger export-trace: error: ") and problem in line, line


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
