"""runs/bench/engine_vii.py's trace reading, on a synthetic trace (plumbing: the script's figures come from a GPU run
only). A forward's GPU window runs from the first to the last device op it launched; its idle share is what no
device op covers inside that window."""
from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from tests.support.bench import bench_script


@pytest.fixture(scope="module")
def engine_vii():
    return bench_script("engine_vii")


def _write(path: Path, events: list[dict]) -> Path:
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events}, f)
    return path


def _launch(ts: int, correlation: int) -> dict:
    return {"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2, "args": {"correlation": correlation}}


def _kernel(ts: int, dur: int, correlation: int) -> dict:
    return {"cat": "kernel", "name": "k", "ts": ts, "dur": dur, "args": {"correlation": correlation}}


def test_forward_idle_is_the_uncovered_share_of_each_forwards_gpu_window(tmp_path, engine_vii):
    """Forward 1 (CPU 0-100 us) launches kernels that run 10-30 and 50-70: window 10-70, busy 40 of 60. Forward 2
    (CPU 200-300) launches one at 210-250 and a memcpy at 240-260 that overlaps it: window 210-260, busy 50 of 50. A
    kernel launched outside every forward (a backward's, 80-90) counts as busy only inside a window it falls in."""
    events = [{"cat": "user_annotation", "name": "forward stage0 mb0", "ts": 0, "dur": 100},
              {"cat": "user_annotation", "name": "forward stage0 mb1", "ts": 200, "dur": 100},
              {"cat": "user_annotation", "name": "backward stage0 mb0", "ts": 100, "dur": 100},
              _launch(5, 1), _launch(40, 2), _launch(120, 3), _launch(205, 4), _launch(230, 5),
              _kernel(10, 20, 1), _kernel(50, 20, 2), _kernel(80, 10, 3), _kernel(210, 40, 4),
              {"cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 240, "dur": 20, "args": {"correlation": 5}}]
    idle = engine_vii.forward_gpu_idle(engine_vii.trace_events(_write(tmp_path / "t.json.gz", events)))
    assert idle["forwards"] == 2
    assert idle["gpu_window_ms_mean"] == pytest.approx((60 + 50) / 2 / 1e3)
    assert idle["kernel_busy_ms_mean"] == pytest.approx((40 + 50) / 2 / 1e3)
    assert idle["gpu_idle_fraction"] == pytest.approx(1 - 90 / 110)
    assert idle["cpu_ms_mean"] == pytest.approx(0.1)


def test_a_trace_without_device_work_has_no_idle_figure(tmp_path, engine_vii):
    events = [{"cat": "user_annotation", "name": "forward stage0 mb0", "ts": 0, "dur": 100},
              {"cat": "cpu_op", "name": "aten::mm", "ts": 10, "dur": 50}]
    assert engine_vii.forward_gpu_idle(engine_vii.trace_events(_write(tmp_path / "cpu.json.gz", events))) is None


def test_a_moe_variant_run_twice_keeps_both_runs_and_every_pair_has_its_ratio(engine_vii, monkeypatch):
    """Plumbing (no run: `trained` stands in, tokens/s by the variant's flags): alternated runs of a variant are kept
    as "name" and "name #2", and the ratios cover every pair in the order they ran."""
    speed = {"--moe-grouped-gemm": 120.0}
    monkeypatch.setattr(engine_vii, "trained", lambda flags, timed: {
        "step_ms_mean": 1.0, "forward_idle": None, "tokens_per_s": max([100.0] + [speed.get(f, 0) for f in flags])})
    args = type("Args", (), dict(cpu_smoke=True, steps=4, timed=2, anchors=".",
                                 moe_variants=["sequential", "grouped-gemm", "sequential"]))()
    out: dict = {}
    engine_vii.moe(args, engine_vii.Budget(1e9), out, lambda: None)
    assert list(out["moe"]) == ["sequential", "grouped-gemm", "sequential #2", "ratios"]
    assert out["moe"]["ratios"] == {"sequential / grouped-gemm": 100 / 120, "sequential / sequential #2": 1.0,
                                    "grouped-gemm / sequential #2": 1.2}
