"""`train-ledger train` and `python -m engine.train`: bad input is one line and status 2; good input trains.

The launcher validates the flags for the whole world before starting any process; under torchrun (RANK set) the
rank validates them itself, rank 0 alone prints the line, and every rank exits 2 before joining a process group.
"""
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from cli.train import next_steps
from common.arguments import parse_args
from ledger.models.formulas.flops import megatron_flops_per_step

CLI = [sys.executable, "-m", "cli.main", "train"]
TIMEOUT = 240


def _run(cmd: list[str], env: dict | None = None, timeout: int = TIMEOUT) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, env=full_env, timeout=timeout)


BAD_INPUT = {
    "heads not divisible by TP": (["--model", "tiny", "--tensor-model-parallel-size", "3"], 3,
                                  "--num-attention-heads 8 is not divisible by --tensor-model-parallel-size 3"),
    "world not divisible": (["--model", "tiny", "--tensor-model-parallel-size", "2"], 3,
                            "world size 3 is not divisible by tp 2"),
    "global batch not divisible": (["--model", "tiny", "--micro-batch-size", "2", "--global-batch-size", "6"], 2,
                                   "--global-batch-size 6 is not divisible by --micro-batch-size 2 x data-parallel "
                                   "size 2"),
    "unknown flag": (["--model", "tiny", "--no-such-flag", "1"], 2, "unsupported flag: --no-such-flag"),
}


def _assert_one_line_error(proc: subprocess.CompletedProcess, message: str) -> None:
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("train-ledger train: error: ") and message in lines[0]


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_with_launcher_is_one_line_and_starts_nothing(case):
    flags, world, message = BAD_INPUT[case]
    proc = _run(CLI + ["--nproc-per-node", str(world)] + flags, timeout=60)
    _assert_one_line_error(proc, message)
    assert "torch.distributed" not in proc.stderr


@pytest.mark.parametrize("case", list(BAD_INPUT))
def test_bad_input_under_torchrun_is_one_line_from_rank0(case):
    flags, world, message = BAD_INPUT[case]
    env = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world)}
    _assert_one_line_error(_run(CLI + flags, env=env, timeout=60), message)
    other = _run(CLI + flags, env={**env, "RANK": "1", "LOCAL_RANK": "1"}, timeout=60)
    assert (other.returncode, other.stdout, other.stderr) == (2, "", "")


def test_bad_launcher_flags():
    proc = _run(CLI + ["--nproc-per-node", "2", "--nnodes", "2", "--model", "tiny"], timeout=60)
    _assert_one_line_error(proc, "--nnodes 2 needs --rdzv-endpoint HOST:PORT")


def _log_lines(stdout: str) -> list[dict[str, float]]:
    pattern = re.compile(r"iteration\s+(\d+)/\s*\d+ \| lm loss: (\S+) \| learning rate: (\S+) \| grad norm: (\S+)"
                         r" \| tokens/s: (\S+) \| step time \(ms\): (\S+) \| throughput per GPU \(TFLOP/s/GPU\): (\S+)")
    return [{"iteration": int(m[1]), "loss": float(m[2]), "lr": float(m[3]), "grad_norm": float(m[4]),
             "tokens_per_s": float(m[5].replace(",", "")), "step_ms": float(m[6]), "tflops": float(m[7])}
            for m in pattern.finditer(stdout)]


@pytest.mark.slow
def test_issue_command_tp2_sp_dp2_trains(tmp_path):
    run_dir = tmp_path / "tp2dp2"
    proc = _run(CLI + ["--nproc-per-node", "4", "--model", "tiny", "--tensor-model-parallel-size", "2",
                       "--sequence-parallel", "--micro-batch-size", "2", "--global-batch-size", "8",
                       "--train-iters", "20", "--run-dir", str(run_dir)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world 4 = tp 2 x cp 1 x dp 2 x pp 1" in proc.stdout
    steps = _log_lines(proc.stdout)
    assert [s["iteration"] for s in steps] == list(range(1, 21))  # rank 0 alone logs
    losses = [s["loss"] for s in steps]
    assert sum(losses[-5:]) < sum(losses[:5]), "the loss must fall"
    assert all(s["tokens_per_s"] > 0 and s["step_ms"] > 0 and s["grad_norm"] > 0 for s in steps)
    # Megatron's "throughput": model FLOPs per step / step time / GPUs; tokens/s and TFLOP/s tell the same time
    flops_per_token = megatron_flops_per_step(parse_args(["--model", "tiny", "--tensor-model-parallel-size", "2",
                                                           "--micro-batch-size", "2", "--global-batch-size", "8"],
                                                          world_size=4)) / (8 * 32)
    for s in steps:
        assert s["tflops"] == pytest.approx(s["tokens_per_s"] * flops_per_token / 4 / 1e12, rel=0.01)
    assert (run_dir / "manifest.json").is_file()
    assert proc.stdout.splitlines()[-4:] == next_steps(run_dir)  # where the run went, and what reads it


@pytest.mark.slow
def test_torchrun_accepts_the_reference_run_sh_flags(tmp_path):
    """runs/megatron/run.sh's flags (8 ranks: TP2 x PP2 x DP2, SP, ZeRO-1, overlaps) with a tiny shape for CPU, for
    two iterations (the warmup's and one after it; the demo trains the same layout for six)."""
    flags = ["--use-mcore-models", "--transformer-impl", "transformer_engine",
             "--num-layers", "4", "--hidden-size", "64", "--ffn-hidden-size", "176",
             "--num-attention-heads", "8", "--group-query-attention", "--num-query-groups", "4",
             "--seq-length", "32", "--max-position-embeddings", "32", "--position-embedding-type", "rope",
             "--rotary-base", "500000",
             "--swiglu", "--normalization", "RMSNorm", "--disable-bias-linear",
             "--untie-embeddings-and-output-weights", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
             "--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2", "--sequence-parallel",
             "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
             "--micro-batch-size", "1", "--global-batch-size", "16",
             "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "1",
             "--train-iters", "2", "--clip-grad", "1.0", "--weight-decay", "0.1", "--adam-beta1", "0.9",
             "--adam-beta2", "0.95", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
             "--split", "99,1,0", "--log-interval", "1", "--eval-iters", "0", "--save-interval", "1000000",
             "--distributed-timeout-minutes", "30", "--run-dir", str(tmp_path / "reference")]
    cfg = parse_args(flags, world_size=8)
    assert (cfg.parallel.data_parallel_size, cfg.num_microbatches) == (2, 8)
    proc = _run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "8",
                 "-m", "engine.train", *flags])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "world 8 = tp 2 x cp 1 x dp 2 x pp 2" in proc.stdout
    assert [s["iteration"] for s in _log_lines(proc.stdout)] == [1, 2]


@pytest.mark.parametrize("flags,message", [
    (["--nproc-per-node", "0"], "--nproc-per-node must be >= 1, got 0"),
    (["--nproc-per-node", "-2"], "--nproc-per-node must be >= 1, got -2")])
def test_no_process_count_below_one(flags, message):
    _assert_one_line_error(_run(CLI + flags + ["--model", "tiny"], timeout=60), message)


def test_an_existing_run_is_refused_before_any_rank_starts(tmp_path):
    (tmp_path / "manifest.json").write_text("{}")
    proc = _run(CLI + ["--nproc-per-node", "2", "--model", "tiny", "--run-dir", str(tmp_path)], timeout=60)
    _assert_one_line_error(proc, f"--run-dir {tmp_path}: already holds a run (manifest.json)")
    assert (tmp_path / "manifest.json").read_text() == "{}"  # what was there is untouched


def _wait_for_steps(run_dir, steps: int, launcher: subprocess.Popen) -> list[int]:
    """The rank pids from the manifest, once rank 0 has logged `steps` steps (the launcher must still run)."""
    events = run_dir / "ranks" / "rank0" / "events.jsonl"
    deadline = time.monotonic() + TIMEOUT
    while not events.is_file() or events.read_bytes().count(b'"kind":"step"') < steps:
        assert launcher.poll() is None, launcher.communicate()[1]
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.2)
    return [r["pid"] for r in json.loads((run_dir / "manifest.json").read_text())["ranks"]]


def _gone(pids: list[int], seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not any(os.path.exists(f"/proc/{pid}") and "zombie" not in open(f"/proc/{pid}/status").read().lower()
                   for pid in pids):
            return True
        time.sleep(0.2)
    return False


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL])
def test_stopping_the_launcher_stops_every_rank_and_fails_the_run(tmp_path, sig):
    """SIGINT / SIGTERM are forwarded to every rank, which records the run as failed; a launcher killed outright
    (SIGKILL) cannot forward anything, and its ranks still stop (each dies with its parent) instead of training on."""
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(CLI + ["--nproc-per-node", "2", "--model", "tiny", "--global-batch-size", "2",
                                       "--train-iters", "100000", "--run-dir", str(run_dir)],
                                env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    pids = _wait_for_steps(run_dir, 3, launcher)
    launcher.send_signal(sig)
    _, stderr = launcher.communicate(timeout=60)
    assert _gone(pids, 30), f"ranks {pids} outlived their launcher"
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["status"] == "failed"
    assert "SIG" in manifest["error"], manifest["error"]
    assert "Traceback" not in stderr, stderr


def test_torchruns_chained_traceback_on_a_signal_reaches_the_user_as_nothing():
    # What torchrun printed when its launcher was SIGTERMed from inside another program (seen: a stray
    # "During handling of the above exception" line reached the user).
    import io

    from cli.train import relay_stderr

    signalled = "torch.distributed.elastic.multiprocessing.api.SignalException: Process 1 got signal: 15\n"
    lines = ["rank line\n", "Traceback (most recent call last):\n", '  File "x.py", line 1\n', signalled, "\n",
             "During handling of the above exception, another exception occurred:\n", "\n",
             "Traceback (most recent call last):\n", '  File "y.py", line 2\n', signalled, "after\n"]
    out = io.StringIO()
    relay_stderr(lines, out)
    assert out.getvalue() == "rank line\nafter\n"
    out = io.StringIO()
    relay_stderr(["Traceback (most recent call last):\n", "  x\n", "ValueError: bad\n"], out)
    assert out.getvalue() == "train-ledger train: torchrun: ValueError: bad\n"


def test_a_missing_dataset_is_one_line_before_any_rank_starts(tmp_path):
    proc = _run(CLI + ["--nproc-per-node", "2", "--model", "tiny", "--data-path", str(tmp_path / "nope"),
                       "--run-dir", str(tmp_path / "run")])
    _assert_one_line_error(proc, "nope.idx: no such index file")
    assert not (tmp_path / "run").exists()


def test_a_ranks_error_reaches_the_user_once_and_what_follows_from_it_not_at_all():
    """Every rank that found the bad input says it; the others are stopped by torchrun because of it. The user reads
    the first line, and the launcher knows that bad input stopped the run (exit status 2)."""
    import io

    from cli.train import relay_stderr

    error = "train-ledger train: error: ck/iter_0000002/rank_00001.pt: is not a whole checkpoint file\n"
    lines = ["train-ledger: world 2 ...\n", error, error.replace("00001", "00000"),
             "W1201 21:05:42.349000 4021 site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] Sending "
             "process 4183 closing signal SIGTERM\n",
             "train-ledger train: stopped by SIGTERM; the run is marked failed\n"]
    out, rank_errors = io.StringIO(), []
    relay_stderr(lines, out, rank_errors)
    assert out.getvalue() == "train-ledger: world 2 ...\n" + error
    assert rank_errors == [error.strip()]


@pytest.mark.parametrize("flag", ["--run-dir", "--save", "--tensorboard-dir"])
def test_an_output_folder_that_cannot_be_written_is_refused_before_any_rank_starts(tmp_path, capsys, monkeypatch,
                                                                                     flag):
    """A read-only mount, and a path under a file: one line naming the flag, nothing started, nothing made."""
    from cli import train
    from cli.main import main
    from tests.support.read_only import read_only_folder

    def started(*_args, **_kwargs):
        raise AssertionError("a rank would have started")

    monkeypatch.setattr(train, "supervise", started)
    (tmp_path / "afile").write_text("")
    with read_only_folder(tmp_path) as read_only:
        for folder, problem in ((read_only / "out", "cannot be written ("),  # read-only, or permission denied
                                (tmp_path / "afile" / "out", f"cannot be written: {tmp_path / 'afile'} is a file")):
            assert main(["train", "--model", "tiny", flag, str(folder)]) == 2
            (line,) = capsys.readouterr().err.splitlines()
            assert line.startswith(f"train-ledger train: error: {flag} {folder}: {problem}"), line
        assert list(read_only.iterdir()) == []


def test_the_launcher_says_where_the_run_went_and_what_to_run_next(tmp_path, capsys, monkeypatch):
    """After the last iteration line: the run directory and the three commands that read it, each as it runs; a run
    without --run-dir is told up front that nothing is recorded."""
    from cli import train
    from cli.main import main

    monkeypatch.setattr(train, "supervise", lambda *_: train.Supervised(status=0, stopped_by=None))
    run = tmp_path / "my run"
    assert main(["train", "--model", "tiny", "--run-dir", str(run)]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"train-ledger train: the run is recorded in {run}; next:",
        f"  train-ledger reconcile '{run}'      # formula | inventory | measurement, row by row",
        f"  train-ledger report '{run}'         # {run}/ledger/report.md and report.html",
        f"  train-ledger dashboard --runs-root {tmp_path} --run 'my run'"]
    assert main(["train", "--model", "tiny"]) == 0
    assert capsys.readouterr().out.startswith("train-ledger train: no --run-dir: nothing is recorded")
