"""Device memory outside PyTorch's allocator: the formula (ledger/models/formulas/device_memory.py) from the H200
calibration and the ledger's own rank groups, judged on real H200 runs.

The calibration (ledger/models/calibration/nvidia_h200.json) was measured by runs/bench/outside_pytorch.py in its own
device call, not by the runs judged here (tests/fixtures/h200_llama1b: see its README)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from common.arguments import parse_args
from common.config import RunConfig
from ledger.models.formulas.device_memory import DeviceOverheads, communicators, outside_pytorch
from tests.support.recorded_runs import reconcile_recorded

FIXTURES = Path(__file__).parent / "fixtures" / "h200_llama1b"
RUNS = ("s4096", "s8192", "s8192-selective", "s8192-full", "8b-4layers")
MiB = 2**20


def cfg(flags: str):
    return parse_args(flags.split(), world_size=int(flags.split("--world-size ")[1].split()[0])
                      if "--world-size" in flags else 1)


def test_a_rank_holds_the_default_communicator_and_one_per_group_of_more_than_one_rank():
    # Megatron's kinds: tp, cp, dp, dp_cp, pp, mp (tp-pp), embedding (both pipeline ends), position (first stage).
    # One GPU: every group is the rank alone, none has a communicator (engine/parallel_state.py).
    assert communicators(cfg("--model tiny"), 0) == 1
    reference = cfg("--model tiny --world-size 8 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2")
    # rank 0: tp [0 1], dp [0 2], dp_cp [0 2], pp [0 4], mp [0 1 4 5], embedding [0 4]; cp [0] and position [0] alone
    assert communicators(reference, 0) == 1 + 6
    assert communicators(reference, 7) == 1 + 6  # the last stage: in an embedding group, in no position group


def test_a_run_recorded_before_groups_of_one_lost_their_communicators_is_counted_as_it_ran():
    """A manifest without ParallelConfig.communicators_for_groups_of_one was written by the engine that built a
    communicator for every group kind, one rank or more: the committed H200 runs (below) held 8 on one GPU."""
    one = cfg("--model tiny").to_dict()
    del one["parallel"]["communicators_for_groups_of_one"]
    assert communicators(RunConfig.from_dict(one), 0) == 1 + 8
    reference = cfg("--model tiny --world-size 8 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2")
    recorded = reference.to_dict()
    del recorded["parallel"]["communicators_for_groups_of_one"]
    assert [communicators(RunConfig.from_dict(recorded), r) for r in (0, 7)] == [1 + 8, 1 + 7]


def test_the_h200_terms_add_up_to_what_the_calibration_measured():
    h200 = DeviceOverheads.known("NVIDIA H200")
    assert h200 is not None and DeviceOverheads.known("Imaginary GPU") is None
    reference = cfg("--model tiny --world-size 8 --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2")
    outside = outside_pytorch(reference, 0, h200)
    # 615 MiB driver reserve (NVML total - CUDA total), 518 MiB context, 650 MiB first and 389 MiB per further
    # communicator, 84 MiB of cuBLAS / attention modules, as measured on 2026-12-01.
    assert [round(b / MiB) for b in outside.terms.values()] == [615, 518, 650, 6 * 389, 84]
    assert outside.total == sum(outside.terms.values())
    # one GPU: the default communicator alone, 3.0 GiB less than the engine that built one for each of 8 groups
    assert outside_pytorch(cfg("--model tiny"), 0, h200).terms["NCCL communicators of 0 groups"] == 0


def reconciled_row(tmp_path, name: str, edit=None):
    run = tmp_path / name
    shutil.copytree(FIXTURES / name, run)
    if edit is not None:
        edit(run)
    (row,) = [r for r in reconcile_recorded(run).rows if r.metric == "memory.outside_pytorch"]
    return row


@pytest.mark.parametrize("name", RUNS)
def test_nvml_used_is_explained_within_2_percent_on_real_h200_runs(tmp_path, name):
    row = reconciled_row(tmp_path, name)
    events = [json.loads(line) for line in (FIXTURES / name / "ranks/rank0/events.jsonl").open()]
    nvml_used = max(e["used_bytes"] for e in events if e["kind"] == "nvml")
    assert row.verdict == "ok", row
    assert abs(row.measured - row.predicted) <= 0.02 * nvml_used
    assert "NCCL communicators of 8 groups" in row.explanation


def test_memory_nobody_predicted_is_off(tmp_path):
    def another_process_takes_3_gib(run: Path) -> None:
        path = run / "ranks/rank0/events.jsonl"
        lines = [json.loads(line) for line in path.open()]
        for e in lines:
            if e["kind"] == "nvml":
                e["used_bytes"] += 3 * 2**30
        path.write_text("".join(json.dumps(e) + "\n" for e in lines))

    assert reconciled_row(tmp_path, "s4096", another_process_takes_3_gib).verdict == "off"


def with_another_process(held: int, listed_with_pids: bool = True):
    """An edit of a run's NVML samples (plumbing: the figures are made up): another process holds `held` bytes on
    the GPU, and NVML's per-process fields say so, or list two processes none of which is this one."""
    def edit(run: Path) -> None:
        path = run / "ranks/rank0/events.jsonl"
        lines = [json.loads(line) for line in path.open()]
        for e in lines:
            if e["kind"] == "nvml":
                own = e["used_bytes"] - 615 * MiB
                e["used_bytes"] += held
                e |= {"processes": 2, "own_bytes": own, "other_processes_bytes": held} if listed_with_pids \
                    else {"processes": 2}
        path.write_text("".join(json.dumps(e) + "\n" for e in lines))
    return edit


def reconciled_rows(tmp_path, name: str, edit) -> dict[str, object]:
    run = tmp_path / name
    shutil.copytree(FIXTURES / name, run)
    edit(run)
    return {r.metric: r for r in reconcile_recorded(run).rows if r.metric.startswith("memory.")}


def test_another_process_on_the_gpu_is_subtracted_and_named(tmp_path):
    rows = reconciled_rows(tmp_path, "s4096", with_another_process(3 * 2**30))
    alone = reconciled_row(tmp_path / "alone", "s4096")
    outside, others = rows["memory.outside_pytorch"], rows["memory.other_processes"]
    assert outside.verdict == "ok" and outside.measured == alone.measured
    assert "other processes' 3,221,225,472 B" in outside.explanation
    assert others.measured == 3 * 2**30 and others.verdict == "off"  # beyond 2% of NVML used
    total = rows["memory.device_total"]
    assert str(f"other processes {3 * 2**30:,}") in total.explanation


def test_a_few_mib_of_another_process_only_warn(tmp_path):
    others = reconciled_rows(tmp_path, "s4096", with_another_process(64 * MiB))["memory.other_processes"]
    assert others.verdict == "warn"


def test_processes_nvml_cannot_tell_apart_are_counted_and_said(tmp_path):
    rows = reconciled_rows(tmp_path, "s4096", with_another_process(3 * 2**30, listed_with_pids=False))
    assert rows["memory.outside_pytorch"].verdict == "off"
    others = rows["memory.other_processes"]
    assert others.measured is None and "PID namespace" in others.explanation


def test_a_run_recorded_without_the_split_has_no_other_processes_row(tmp_path):
    assert "memory.other_processes" not in reconciled_rows(tmp_path, "s4096", lambda run: None)


def test_an_uncalibrated_device_is_measured_only_and_says_how_to_calibrate(tmp_path):
    def rename_device(run: Path) -> None:
        manifest = json.loads((run / "manifest.json").read_text())
        manifest["ranks"][0]["device"]["name"] = "Imaginary GPU"
        (run / "manifest.json").write_text(json.dumps(manifest))

    row = reconciled_row(tmp_path, "s4096", rename_device)
    assert row.predicted is None and row.verdict == "n/a"
    assert "runs/bench/outside_pytorch.py" in row.explanation


PROCESSES = Path(__file__).parent / "fixtures" / "h200_nvml_processes"


def real_memory_rows(tmp_path, name: str, edit=None) -> dict[str, object]:
    run = tmp_path / name
    shutil.copytree(PROCESSES / name, run)
    if edit is not None:
        edit(run)
    return {r.metric: r for r in reconcile_recorded(run).rows if r.metric.startswith("memory.")}


def without_the_split(run: Path) -> None:
    """The samples as the probe wrote them before it split NVML's used bytes by process."""
    path = run / "ranks/rank0/events.jsonl"
    lines = [json.loads(line) for line in path.open()]
    for e in lines:
        for key in ("processes", "own_bytes", "other_processes_bytes"):
            e.pop(key, None)
    path.write_text("".join(json.dumps(e) + "\n" for e in lines))


def test_on_a_real_h200_another_processes_4_gib_are_named_and_not_counted_as_the_runs(tmp_path):
    """The same run alone and beside a process holding a 4 GiB tensor (nvidia-smi: 4,614 MiB, its context included):
    the split names exactly that, and memory outside PyTorch is the run's own in both, within the 2% bar."""
    alone, beside = real_memory_rows(tmp_path, "alone"), real_memory_rows(tmp_path, "cotenant")
    assert alone["memory.other_processes"].measured == 0 and alone["memory.other_processes"].verdict == "ok"
    others = beside["memory.other_processes"]
    assert others.measured == 4614 * MiB and others.verdict == "off"
    for rows in (alone, beside):
        assert rows["memory.outside_pytorch"].verdict == "ok", rows["memory.outside_pytorch"]
    assert abs(beside["memory.outside_pytorch"].measured - alone["memory.outside_pytorch"].measured) < 16 * MiB


def test_without_the_split_the_other_process_lands_outside_pytorch(tmp_path):
    rows = real_memory_rows(tmp_path, "cotenant", without_the_split)
    assert rows["memory.outside_pytorch"].verdict == "off"
    assert "memory.other_processes" not in rows
