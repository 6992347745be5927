"""Checkpoints (engine/checkpointing.py): a resumed run continues bit for bit, a kill during a save loses only that
save, the load options take what they say, and bad checkpoint flags are one line and exit 2 before anything starts.

Why bit for bit is the right expectation: the engine is deterministic on the CPU, the mock data's samples are a pure
function of (seed, index), and a checkpoint holds every piece of state a step reads (param buffers, main params, Adam
m, v and step, the scheduler's step count, the data position). So the same flags must give the same floats, compared
with == and torch.equal, not a tolerance.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time

import pytest
import torch

from common.arguments import parse_args
from common.config import LATEST_CHECKPOINT_FILE, checkpoint_layout
from common.errors import ConfigError, InputError
from engine import checkpointing
from probes.probe_set import NullProbeSet
from tests.support.gloo import run_distributed
from tests.support.parity import train_alone, train_rank

TINY = ["--model", "tiny", "--num-layers", "2", "--micro-batch-size", "1", "--global-batch-size", "2",
        "--lr", "3e-3", "--lr-warmup-iters", "1", "--mock-data"]


def _assert_params_equal(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, value in expected.items():
        assert torch.equal(actual[name], value), name


# --- bit-exact resume on gloo --------------------------------------------------------------------------------------

# The distributed optimizer's sharded state is covered by its --async-save case alone: the async save writes the
# same per-rank state, from a thread, so a blocking case of it would run the same resume again. A blocking save on
# several ranks is the pp2 case's (and tests/test_checkpoint_reshard.py loads a blocking DP2 ZeRO-1 save exactly).
LAYOUTS = {
    "pp2": (2, ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"]),
    "dp2-distributed-optimizer-async-save": (2, ["--global-batch-size", "4", "--use-distributed-optimizer", "--bf16",
                                                 "--async-save"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_resume_continues_bit_for_bit(layout, tmp_path):
    """6 steps straight == 3 steps, stop at --exit-interval 3 (which saves), then --load and 3 more."""
    world, flags = LAYOUTS[layout]
    argv = TINY + flags + ["--train-iters", "6", "--save-interval", "3"]
    straight = run_distributed(train_rank, world, argv + ["--save", str(tmp_path / "straight")])
    resumed_dir = str(tmp_path / "resumed")
    first = run_distributed(train_rank, world, argv + ["--save", resumed_dir, "--exit-interval", "3"])
    assert (tmp_path / "resumed" / LATEST_CHECKPOINT_FILE).read_text().strip() == "3"
    second = run_distributed(train_rank, world, argv + ["--save", resumed_dir, "--load", resumed_dir])
    for rank in range(world):
        assert len(straight[rank]["losses"]) == 6 and straight[rank]["losses"][-1] < straight[rank]["losses"][0]
        assert first[rank]["losses"] == straight[rank]["losses"][:3]
        assert second[rank]["losses"] == straight[rank]["losses"][3:]
        assert second[rank]["lrs"] == straight[rank]["lrs"][3:]
        _assert_params_equal(second[rank]["params"], straight[rank]["params"])


# --- a kill during a save ------------------------------------------------------------------------------------------

class Killed(BaseException):
    """Stands for SIGKILL at one point of a save: nothing after it runs."""


def _die(*_args, **_kwargs):
    raise Killed


def _killed_while_writing_a_rank_file(monkeypatch, iteration: int) -> None:
    real_save = torch.save

    def save(obj, path, *args, **kwargs):
        if f"iter_{iteration:07d}.tmp" in str(path):
            path.write_bytes(b"half a file")
            raise Killed
        real_save(obj, path, *args, **kwargs)
    monkeypatch.setattr(checkpointing.torch, "save", save)


def _killed_before_the_pointer_is_written(monkeypatch, iteration: int) -> None:
    real = checkpointing._write_atomically

    def write(path, text):
        if text.strip() == str(iteration):
            _die()
        real(path, text)
    monkeypatch.setattr(checkpointing, "_write_atomically", write)


@pytest.mark.parametrize("save_mode", [[], ["--async-save"]], ids=["blocking", "async"])
@pytest.mark.parametrize("kill", [_killed_while_writing_a_rank_file, _killed_before_the_pointer_is_written])
def test_a_kill_during_a_save_resumes_from_the_previous_complete_checkpoint(kill, save_mode, tmp_path,
                                                                             monkeypatch):
    """Under --async-save the kill strikes the background thread; its error reaches the training loop when the
    loop finishes the save (a real kill takes the daemon thread with the process, leaving the same files)."""
    argv = TINY + ["--train-iters", "4", "--save-interval", "2", "--save", str(tmp_path), *save_mode]
    straight = train_alone(TINY + ["--train-iters", "4"])
    with monkeypatch.context() as patch:
        kill(patch, 4)
        with pytest.raises(Killed):
            train_alone(argv)
    assert (tmp_path / LATEST_CHECKPOINT_FILE).read_text().strip() == "2"
    resumed = train_alone(argv + ["--load", str(tmp_path)])
    assert resumed["losses"] == straight["losses"][2:]
    _assert_params_equal(resumed["params"], straight["params"])
    assert (tmp_path / LATEST_CHECKPOINT_FILE).read_text().strip() == "4"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["iter_0000002", "iter_0000004", LATEST_CHECKPOINT_FILE]


# --- --async-save ---------------------------------------------------------------------------------------------------

class Recorder(NullProbeSet):
    """Probes that keep the checkpoint events and call `on_step_end(iteration)` after each step."""

    def __init__(self, on_step_end=lambda iteration: None):
        self.events: list[dict] = []
        self.on_step_end = on_step_end

    def checkpoint(self, action: str, **fields) -> None:
        self.events.append({"action": action, **fields})

    def step_end(self, iteration: int, **figures) -> None:
        self.on_step_end(iteration)


def test_an_async_save_is_written_while_training_goes_on_and_resumes_bit_for_bit(tmp_path, monkeypatch):
    """The write of the save at iteration 2 waits until iteration 3 has ended: were the save blocking, training
    could never reach iteration 3 and the write would give up. The copy taken at iteration 2 is what is written
    (training has moved the parameters on by then), so resuming from it continues bit for bit."""
    step_3_done = threading.Event()
    real_save = torch.save

    def save_after_step_3(obj, path, *args, **kwargs):
        if "iter_0000002" in str(path):
            assert step_3_done.wait(timeout=60), "the save blocked training"
        real_save(obj, path, *args, **kwargs)
    monkeypatch.setattr(checkpointing.torch, "save", save_after_step_3)
    recorder = Recorder(lambda iteration: iteration == 3 and step_3_done.set())
    argv = TINY + ["--train-iters", "4", "--save-interval", "2", "--save", str(tmp_path), "--async-save"]
    straight = train_alone(TINY + ["--train-iters", "4"])
    assert train_alone(argv, probes=recorder)["losses"] == straight["losses"]
    saves = [e for e in recorder.events if e["action"] == "save"]
    assert [e["iteration"] for e in saves] == [2, 4]
    for event in saves:
        assert event["async_save"] and event["background_seconds"] >= event["write_seconds"] > 0
        assert event["bytes"] == (tmp_path / f"iter_{event['iteration']:07d}" / "rank_00000.pt").stat().st_size
    assert saves[0]["background_seconds"] > saves[0]["blocking_seconds"]  # it waited for step 3 in the background

    monkeypatch.undo()
    shutil.rmtree(tmp_path / "iter_0000004")
    (tmp_path / LATEST_CHECKPOINT_FILE).write_text("2\n")
    resumed = train_alone(argv + ["--load", str(tmp_path)])
    assert resumed["losses"] == straight["losses"][2:]
    _assert_params_equal(resumed["params"], straight["params"])


KILLED_IN_THE_BACKGROUND = """
import os, signal, sys
import torch
from engine import checkpointing
from tests.support.parity import train_alone
real_save = torch.save
def save(obj, path, *args, **kwargs):
    if "iter_0000004" in str(path):
        path.write_bytes(b"half a file")
        os.kill(os.getpid(), signal.SIGKILL)
    real_save(obj, path, *args, **kwargs)
checkpointing.torch.save = save
train_alone(sys.argv[1:])
"""


@pytest.mark.slow
def test_a_process_killed_during_a_background_write_leaves_the_previous_checkpoint(tmp_path):
    """A real SIGKILL of the whole process while the background thread writes iteration 4's file."""
    argv = TINY + ["--train-iters", "6", "--save-interval", "2", "--save", str(tmp_path), "--async-save"]
    killed = subprocess.run([sys.executable, "-c", KILLED_IN_THE_BACKGROUND, *argv], capture_output=True, text=True,
                            timeout=120)
    assert killed.returncode == -9, killed.stderr[-2000:]
    assert (tmp_path / LATEST_CHECKPOINT_FILE).read_text().strip() == "2"
    assert (tmp_path / "iter_0000004.tmp" / "rank_00000.pt.part").read_bytes() == b"half a file"
    straight = train_alone(TINY + ["--train-iters", "6"])
    resumed = train_alone(argv + ["--load", str(tmp_path)])
    assert resumed["losses"] == straight["losses"][2:]
    _assert_params_equal(resumed["params"], straight["params"])
    assert (tmp_path / LATEST_CHECKPOINT_FILE).read_text().strip() == "6"


def test_a_blocking_save_has_no_background_part(tmp_path):
    recorder = Recorder()
    train_alone(TINY + ["--train-iters", "2", "--save", str(tmp_path)], probes=recorder)
    (save,) = [e for e in recorder.events if e["action"] == "save"]
    assert not save["async_save"] and save["background_seconds"] == 0.0
    assert save["blocking_seconds"] >= save["write_seconds"] > 0


# --- --exit-duration-in-mins ---------------------------------------------------------------------------------------

def test_exit_duration_stops_after_the_first_iteration_past_it_saving_first(tmp_path, capsys):
    """A duration of a microsecond has passed by the end of the first iteration: the run saves and stops there,
    and a resumed run continues bit for bit. A million minutes have not passed: the run goes on to
    --train-iters."""
    argv = TINY + ["--train-iters", "4", "--save", str(tmp_path)]
    straight = train_alone(TINY + ["--train-iters", "4"])
    stopped = train_alone(argv + ["--exit-duration-in-mins", "1e-8"])
    assert stopped["losses"] == straight["losses"][:1]
    assert (tmp_path / LATEST_CHECKPOINT_FILE).read_text().strip() == "1"
    resumed = train_alone(argv + ["--load", str(tmp_path)])
    assert resumed["losses"] == straight["losses"][1:]
    _assert_params_equal(resumed["params"], straight["params"])
    unlimited = train_alone(TINY + ["--train-iters", "2", "--exit-duration-in-mins", "1e6"])
    assert unlimited["losses"] == straight["losses"][:2]


def train_with_a_late_clock_on_rank_1(rank: int, world_size: int, argv: list[str]) -> dict:
    """A gloo rank whose clock, on rank 1 only, reads an hour late when the Checkpointer asks it after a step (its
    start-up time was read from the real clock, when engine.checkpointing was imported)."""
    if rank == 1:
        real = time.monotonic
        time.monotonic = lambda: real() + 3600
    return train_rank(rank, world_size, argv)


@pytest.mark.slow
def test_exit_duration_stops_every_rank_at_the_same_iteration(tmp_path):
    """Rank 1 believes an hour has passed, rank 0 does not: the MAX all-reduce stops both after iteration 1, and
    the save at that iteration is whole (both ranks wrote their file)."""
    argv = TINY + ["--global-batch-size", "4", "--train-iters", "4", "--save", str(tmp_path),
                   "--exit-duration-in-mins", "30"]
    results = run_distributed(train_with_a_late_clock_on_rank_1, 2, argv)
    assert [len(r["losses"]) for r in results] == [1, 1]
    assert (tmp_path / LATEST_CHECKPOINT_FILE).read_text().strip() == "1"
    assert sorted(p.name for p in (tmp_path / "iter_0000001").glob("rank_*.pt")) == ["rank_00000.pt",
                                                                                    "rank_00001.pt"]


# --- what --load takes ---------------------------------------------------------------------------------------------

def test_load_options_take_what_they_say(tmp_path):
    """After a save at 2 of 4 steps (--exit-interval 2): --no-load-optim keeps params and data position (so step
    3's loss, computed before any update, is unchanged) but restarts Adam and the schedule (so the update differs);
    --finetune takes the params only and trains iterations 1..4 from the first batch; --no-load-rng leaves the
    global RNG as it was (training draws nothing from it, so with the RNG loaded the state at the end is the
    saved one whatever the seed before)."""
    save = str(tmp_path)
    straight = train_alone(TINY + ["--train-iters", "4"])
    assert train_alone(TINY + ["--train-iters", "4", "--exit-interval", "2", "--save", save])["losses"] == \
        straight["losses"][:2]
    torch.manual_seed(0)
    full = train_alone(TINY + ["--train-iters", "4", "--load", save])
    after_full_load = torch.get_rng_state()
    assert full["losses"] == straight["losses"][2:]

    no_optim = train_alone(TINY + ["--train-iters", "4", "--load", save, "--no-load-optim"])
    assert no_optim["losses"][0] == straight["losses"][2]
    assert no_optim["losses"][1] != straight["losses"][3]
    assert no_optim["lrs"][0] == 0.0  # warm-up starts again from init_lr

    fresh = train_alone(TINY + ["--train-iters", "4"])
    finetune = train_alone(TINY + ["--train-iters", "4", "--load", save, "--finetune"])
    assert len(finetune["losses"]) == 4 and finetune["losses"][0] != fresh["losses"][0]

    torch.manual_seed(0)
    train_alone(TINY + ["--train-iters", "4", "--load", save, "--no-load-rng"])
    assert not torch.equal(torch.get_rng_state(), after_full_load)
    torch.manual_seed(0)
    train_alone(TINY + ["--train-iters", "4", "--load", save])
    assert torch.equal(torch.get_rng_state(), after_full_load)


def test_load_of_an_empty_directory_starts_from_scratch_and_says_so(tmp_path, capsys):
    """Megatron's behaviour: a --load without a checkpoint is the first run of a job that will resume later."""
    cfg = parse_args(TINY + ["--load", str(tmp_path)], world_size=1)
    checkpointer = checkpointing.Checkpointer(cfg, model=[], optimizer=None, scheduler=None, data_iterators=[],
                                              log=True)
    assert checkpointer.load() == 0
    assert capsys.readouterr().out == (f"train-ledger: --load {tmp_path} holds no checkpoint "
                                       f"({LATEST_CHECKPOINT_FILE}): training from scratch\n")
    fresh = train_alone(TINY + ["--train-iters", "2"])
    loaded = train_alone(TINY + ["--train-iters", "2", "--load", str(tmp_path)])
    assert loaded["losses"] == fresh["losses"]


def test_a_load_path_that_does_not_exist_is_refused(tmp_path):
    """A typo in --load must not restart a run from scratch; leaving out --load is how to start fresh."""
    missing = tmp_path / "ckpt-typo"
    with pytest.raises(ConfigError, match=f"--load {missing}: does not exist; to start from scratch leave out --load"):
        parse_args(TINY + ["--load", str(missing)], world_size=1)
    (tmp_path / "afile").write_text("")
    with pytest.raises(ConfigError, match="is a file, not a checkpoint directory"):
        parse_args(TINY + ["--load", str(tmp_path / "afile")], world_size=1)


def test_the_save_directory_before_its_first_save_starts_from_scratch(tmp_path):
    """A job that resumes itself passes one DIR to --save and --load; its first start finds nothing there yet."""
    first = str(tmp_path / "ckpt")
    assert parse_args(TINY + ["--save", first, "--load", first], world_size=1).checkpoint.load == first


# --- bad input -----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("damage", ["random bytes", "truncated"])
def test_a_damaged_rank_file_is_an_input_error_naming_it(tmp_path, damage):
    """torch.load's own message would suggest weights_only=False (which runs arbitrary code) or quote a zip reader."""
    from engine.checkpoint_reshard import load_rank_file

    whole = tmp_path / "whole.pt"
    torch.save({"param_buffers": [torch.zeros(1000)]}, whole)
    path = tmp_path / "rank_00000.pt"
    path.write_bytes(bytes(range(256)) * 8 if damage == "random bytes" else whole.read_bytes()[:500])
    with pytest.raises(InputError) as raised:
        load_rank_file(path)
    assert str(raised.value) == f"{path}: is not a whole checkpoint file (truncated or corrupt; it loads only as " \
                                "torch.save wrote it)"
    assert load_rank_file(whole)["param_buffers"][0].shape == (1000,)


@pytest.mark.slow
def test_a_damaged_checkpoint_stops_every_rank_at_load_with_its_cause(tmp_path):
    """2 gloo ranks resume from a checkpoint whose rank 1 file is cut short: one line naming that file, exit 2, no
    step trained, and the manifest (which reconcile repeats) records that file, not a lost peer or a SIGTERM."""
    cli = [sys.executable, "-m", "cli.main", "train", "--nproc-per-node", "2", *TINY]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    save = subprocess.run(cli + ["--train-iters", "2", "--save", str(tmp_path / "ck")], capture_output=True, text=True,
                          env=env, timeout=300)
    assert save.returncode == 0, save.stderr
    damaged = tmp_path / "ck" / "iter_0000002" / "rank_00001.pt"
    damaged.write_bytes(damaged.read_bytes()[:500])
    run = tmp_path / "run"
    resume = subprocess.run(cli + ["--train-iters", "4", "--load", str(tmp_path / "ck"), "--run-dir", str(run)],
                            capture_output=True, text=True, env=env, timeout=300)
    expected = f"{damaged}: is not a whole checkpoint file (truncated or corrupt; it loads only as torch.save wrote it)"
    assert resume.returncode == 2
    assert resume.stderr.splitlines() == [f"train-ledger train: error: {expected}"]
    assert "iteration" not in resume.stdout
    manifest = json.loads((run / "manifest.json").read_text())
    assert manifest["status"] == "failed" and expected in manifest["error"]

BAD_FLAGS = {
    "zero save interval": (["--save", "ckpt", "--save-interval", "0"], "--save-interval must be >= 1, got 0"),
    "negative exit interval": (["--exit-interval", "-1"], "--exit-interval must be >= 1, got -1"),
    "exit after the last iteration": (["--train-iters", "4", "--exit-interval", "5"],
                                      "--exit-interval 5 is beyond --train-iters 4"),
    "finetune without load": (["--finetune"], "--finetune needs --load DIR"),
    "zero exit duration": (["--exit-duration-in-mins", "0"], "--exit-duration-in-mins must be a number of minutes > 0"),
    "negative exit duration": (["--exit-duration-in-mins", "-5"], "minutes > 0, got -5.0"),
    "infinite exit duration": (["--exit-duration-in-mins", "inf"], "minutes > 0, got inf"),
    "not-a-number exit duration": (["--exit-duration-in-mins", "nan"], "minutes > 0, got nan"),
    "non-numeric exit duration": (["--exit-duration-in-mins", "soon"], "--exit-duration-in-mins: invalid float"),
    "async save without save": (["--async-save"], "--async-save needs --save DIR"),
}


@pytest.mark.parametrize("case", list(BAD_FLAGS))
def test_bad_checkpoint_flags_are_refused(case):
    flags, message = BAD_FLAGS[case]
    with pytest.raises(ConfigError, match=message):
        parse_args(TINY + flags, world_size=1)


def _fake_checkpoint(directory, argv: list[str], world_size: int, iteration: int = 3) -> None:
    """A checkpoint directory's metadata only (synthetic: the layout check reads nothing else)."""
    iter_dir = directory / f"iter_{iteration:07d}"
    iter_dir.mkdir(parents=True)
    layout = checkpoint_layout(parse_args(argv, world_size=world_size))
    (iter_dir / "layout.json").write_text(json.dumps(layout))
    (directory / LATEST_CHECKPOINT_FILE).write_text(f"{iteration}\n")


def test_a_checkpoint_of_another_model_shape_is_refused_by_the_cli_before_any_rank_starts(tmp_path):
    """(Another parallel layout reshards: tests/test_checkpoint_reshard.py.)"""
    _fake_checkpoint(tmp_path, TINY + ["--hidden-size", "128"], world_size=1)
    proc = subprocess.run([sys.executable, "-m", "cli.main", "train", *TINY, "--load", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and proc.stdout == "", proc
    assert len(lines) == 1, lines
    assert "iter_0000003 was saved with hidden_size 128, this run has 64" in lines[0], lines


def test_same_layout_is_accepted_and_other_shapes_or_optimizers_are_not(tmp_path):
    _fake_checkpoint(tmp_path, TINY, world_size=1)
    parse_args(TINY + ["--load", str(tmp_path)], world_size=1)
    parse_args(TINY + ["--load", str(tmp_path), "--seq-length", "16", "--lr", "1e-3"], world_size=1)  # not layout
    for flags, key in ((["--hidden-size", "128"], "hidden_size"), (["--bf16"], "params_dtype"),
                       (["--use-distributed-optimizer"], "use_distributed_optimizer"),
                       (["--global-batch-size", "4"], "global_batch_size")):
        with pytest.raises(ConfigError, match=f"saved with {key} "):
            parse_args(TINY + flags + ["--load", str(tmp_path)], world_size=1)


def test_a_pointer_to_a_missing_checkpoint_is_refused(tmp_path):
    (tmp_path / LATEST_CHECKPOINT_FILE).write_text("7\n")
    with pytest.raises(ConfigError, match="names iteration 7, but iter_0000007/layout.json is missing"):
        parse_args(TINY + ["--load", str(tmp_path)], world_size=1)
