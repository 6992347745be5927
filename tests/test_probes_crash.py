"""A rank SIGKILLed mid-run leaves its events readable up to its last completed step and the manifest "running"."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.run_dir import EventStream, events_path, read_manifest
from tests.support.probed_loop import MICROBATCHES

REPO = Path(__file__).resolve().parent.parent


def _completed_steps(path: Path) -> int:
    if not path.is_file():
        return 0
    return path.read_bytes().count(b'"kind":"step"')


@pytest.mark.slow
def test_sigkill_leaves_completed_steps_readable(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    child = subprocess.Popen([sys.executable, "-c", f"from tests.support.probed_loop import run_until_killed; "
                              f"run_until_killed({str(run_dir)!r})"], cwd=REPO, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 60
    try:
        while _completed_steps(events_path(run_dir, 0)) < 5:
            assert child.poll() is None, child.stderr.read().decode()
            assert time.monotonic() < deadline, "the child made no progress"
            time.sleep(0.05)
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    assert child.returncode == -signal.SIGKILL

    manifest = read_manifest(run_dir)
    assert manifest["status"] == "running" and manifest["ended"] is None
    # What a torn final write looks like; the reader must skip it and say so.
    with open(events_path(run_dir, 0), "ab") as f:
        f.write(b'{"kind":"timing","step":99,"na')
    stream = EventStream(run_dir, 0)
    events = list(stream)
    assert stream.torn_tail
    steps = [e.step for e in events if e.kind == "step"]
    assert len(steps) >= 5 and steps == list(range(1, len(steps) + 1))
    for step in steps:  # every completed step is whole: its timings and its memory record precede it
        forward = [e for e in events if e.kind == "timing" and e.step == step and e.category == "forward"]
        assert len(forward) == MICROBATCHES
        assert any(e.kind == "memory" and e.point == "step" and e.step == step for e in events)
    assert not any(e.kind == "run_end" for e in events)
