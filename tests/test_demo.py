"""`train-ledger demo` end to end on the CPU, started the way the README's first set-up command starts it: the
console script with no arguments, from a fresh directory (so the default run directory is exercised too). Eight gloo
ranks train the reference run's TP2 x PP2 x DP2 layout with every probe on, then the run is reconciled and reported.

SLOW: one whole demo run, about a minute on an idle 2-core machine, several on a loaded one (`-m "not slow"`
leaves it out). CUDA is hidden from it so that the CPU path is what runs, on any machine.
"""
from __future__ import annotations

import gzip
import json
import os
import re
import shlex
import shutil
import subprocess
from fractions import Fraction
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
APP = Path(__file__).resolve().parents[1] / "dashboard" / "app.py"
DEMO_TIMEOUT = 1500  # seconds; the run itself takes ~1 min idle


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    exe = shutil.which("train-ledger")
    assert exe, "the train-ledger console script is not on PATH (pip install -e '.[dashboard]')"
    cwd = tmp_path_factory.mktemp("demo")
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    done = subprocess.run([exe, "demo"], cwd=cwd, env=env, capture_output=True, text=True, timeout=DEMO_TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return cwd, done


@pytest.fixture(scope="module")
def run(demo: tuple[Path, subprocess.CompletedProcess]) -> Path:
    cwd, _ = demo
    runs = sorted((cwd / "runs" / "out").glob("demo-*"))
    assert len(runs) == 1, runs
    return runs[0]


def manifest(run: Path) -> dict:
    return json.loads((run / "manifest.json").read_text())


def test_cpu_demo_buckets_give_overlap_something_to_show() -> None:
    """The ledger's own layout of the CPU demo's buffers (Megatron's rule, ledger.models.formulas.buffer_layout): the
    first stage's layers fill several buckets, each with a predicted overlap but the last one issued (the embedding's
    own bucket, which has no backward left to hide behind)."""
    from cli.demo import choose_layout, demo_flags
    from common.arguments import parse_args
    from ledger.models.formulas.buffer_layout import rank_buffers

    layout = choose_layout(0)
    cfg = parse_args(demo_flags(layout, 4, Path("unused"))[:-2], world_size=layout.world)
    (first_stage,) = rank_buffers(cfg, pp_rank=0)
    assert len(first_stage.buckets) - 1 >= 3  # buckets whose overlap is predicted, beside the last one issued


@pytest.mark.parametrize("gpus", [0, 1, 2, 4, 8])
def test_the_demos_default_steps_leave_a_steady_step_outside_the_profiler_on_every_device(gpus: int) -> None:
    """The demo's own flags, parsed as the engine parses them, on each layout it picks (the CPU's and each GPU
    count's): the ledger's step selection from the config's profiler window (ledger.evidence.steps, as for records
    without flags) leaves at least one of the default steps steady (not the first, not profiled, not after the trace
    export), so throughput.step_time has a measurement. The profiler records steps 2-3 and one more, and in a world
    of more than one every rank waits for the slowest export in step 5: the first steady step is 6 (5 alone)."""
    from cli.demo import choose_layout, demo_flags, parser
    from common.arguments import parse_args
    from ledger.evidence.steps import select_steps

    iters = parser().parse_args([]).train_iters
    layout = choose_layout(gpus)
    cfg = parse_args(demo_flags(layout, iters, Path("unused"))[:-2], world_size=layout.world)
    steady = select_steps(cfg, layout.world, [], range(1, iters + 1)).steady(range(1, iters + 1))
    assert steady == ([5, 6] if layout.world == 1 else [6])


@pytest.mark.parametrize("iters", ["5", "0", "1001"])
def test_fewer_demo_steps_than_a_steady_one_needs_is_one_line_exit_2(iters: str, capsys) -> None:
    import cli.main as cli

    assert cli.main(["demo", "--train-iters", iters]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"--train-iters {iters}: the demo takes 6" in err


def test_timing_note_is_given_when_ranks_outnumber_cores() -> None:
    from cli.demo import Layout, timing_note

    cpu = Layout(world=8, tp=2, pp=2, gpu=False)
    note = timing_note(cpu, cores=2)
    assert note.startswith("timings: 8 ranks share this machine's 2 cores") and "not judged" in note
    assert timing_note(cpu, cores=None) is not None  # an unknown count is the ledger's "shared" too
    assert timing_note(cpu, cores=8) is None and timing_note(Layout(world=8, tp=2, pp=2, gpu=True), cores=2) is None


def test_readme_first_set_up_command_runs_the_demo() -> None:
    text = README.read_text()
    first_block = re.search(r"## Set up.*?```\n(.*?)```", text, re.S).group(1).strip()
    assert first_block.endswith("&& train-ledger demo"), first_block


def test_readme_says_where_to_look_after_the_demo() -> None:
    text = README.read_text()
    first = re.search(r"open these three pages first: (.*?);", text, re.S).group(1)
    pages = re.findall(r"\*\*(\w+)\*\*", first)
    assert len(pages) == 3 and all((APP.parent / "pages" / f"{p.lower()}.py").is_file() for p in pages), pages
    assert "Debian's `chromium`" in text and "`.ci/run` installs" in text  # what the browser test needs


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT + 60)
def test_progress_is_shown_phase_by_phase(demo) -> None:
    out = demo[1].stdout
    marks = ["demo: [1/3] training", " iteration        1/", " iteration        6/", "demo: [2/3] reconciling",
             "demo: [3/3] writing the report", "headline (", "open it in the dashboard:"]
    positions = [out.find(m) for m in marks]
    assert -1 not in positions and positions == sorted(positions), dict(zip(marks, positions))


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT + 60)
def test_the_profiler_window_adds_no_kineto_lines(demo) -> None:
    """torch 2.13's Kineto logs a start and a stop line per window and rank (32 in the demo) unless told not to
    (probes/profiler.py)."""
    assert "SyncActivityProfilerHandler" not in demo[1].stdout + demo[1].stderr


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT + 60)
def test_run_directory_is_complete_for_eight_ranks(run: Path) -> None:
    m = manifest(run)
    assert m["status"] == "complete" and m["world_size"] == 8
    assert sorted(r["rank"] for r in m["ranks"]) == list(range(8))
    coords = {(r["coords"]["tp"], r["coords"]["dp"], r["coords"]["pp"]) for r in m["ranks"]}
    assert coords == {(t, d, p) for t in (0, 1) for d in (0, 1) for p in (0, 1)}
    for rank in range(8):
        last = json.loads((run / "ranks" / f"rank{rank}" / "events.jsonl").read_text().splitlines()[-1])
        assert (last["kind"], last["status"]) == ("run_end", "complete")
    traces = sorted((run / "traces").glob("rank*.step2-3.json.gz"))
    assert len(traces) == 8  # the profiler window on every rank
    for path in traces:
        assert json.loads(gzip.decompress(path.read_bytes()))["trainLedger"]["run_id"] == m["run_id"]
    for name in ("reconciliation.json", "reconciliation.csv", "report.md", "report.html"):
        assert (run / "ledger" / name).is_file(), name


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT + 60)
def test_bubble_row_shows_the_analytic_figure(demo, run: Path) -> None:
    cfg = manifest(run)["config"]
    par, train = cfg["parallel"], cfg["train"]
    p = par["pipeline_model_parallel_size"]
    dp = par["world_size"] // (par["tensor_model_parallel_size"] * p)
    m = train["global_batch_size"] // (train["micro_batch_size"] * dp)
    assert (p, m) == (2, 8)  # the reference run's pipeline: 2 stages, 8 micro-batches
    expected = Fraction(p - 1, m + p - 1)  # idle slots over the stage's wall time, one model chunk per stage
    (line,) = [line for line in demo[1].stdout.splitlines() if line.lstrip().startswith("pipeline bubble")]
    assert f"formula {100 * float(expected):.2f}% ({expected})" in line, line


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT + 60)
def test_headline_static_memory_formula_matches_inventory(demo) -> None:
    lines = {line.split("  ")[1].strip(): line for line in demo[1].stdout.splitlines()
             if line.startswith("  ") and "formula" in line}
    for label in ("bytes/param", "static memory after step 1"):
        assert "[ok;" in lines[label], lines[label]  # the engine's inventory equals the formula on every rank


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT + 60)
def test_printed_dashboard_command_opens_the_run(demo, run: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cwd, done = demo
    argv = shlex.split(done.stdout.strip().splitlines()[-1])
    assert argv[:3] == ["train-ledger", "dashboard", "--runs-root"] and argv[4] == "--run", argv
    root, name = cwd / argv[3], argv[5]
    assert (root / name).resolve() == run.resolve()
    pytest.importorskip("streamlit")
    from streamlit.testing.v1 import AppTest

    from dashboard import state
    from dashboard.launch import RUN_ENV, RUNS_ROOT_ENV

    # What `train-ledger dashboard` hands the app (it execs Streamlit with these two variables set).
    monkeypatch.setenv(RUNS_ROOT_ENV, str(root.resolve()))
    monkeypatch.setenv(RUN_ENV, name)
    at = AppTest.from_file(str(APP), default_timeout=120)
    at.run()
    assert at.session_state[state.SELECTED] == name
    for page in ("runs", "reconciliation", "memory", "pipeline", "overlap", "topology", "traces"):
        at.switch_page(f"pages/{page}.py").run()
        assert not at.exception and not at.error, (page, [e.value for e in [*at.exception, *at.error]])


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT + 60)
def test_cpu_memory_is_measured_and_labelled(demo) -> None:
    (line,) = [line for line in demo[1].stdout.splitlines() if line.lstrip().startswith("bytes/param")]
    measured = line.split("| measured ")[1]
    assert not measured.startswith(("-", "—")) and "(CPU tensor census)" in measured and "[ok;" in line, line


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT + 60)
def test_first_stage_overlap_rows_have_several_predicted_buckets(run: Path) -> None:
    rows = json.loads((run / "ledger" / "reconciliation.json").read_text())["rows"]
    first_stage = {r["rank"] for r in manifest(run)["ranks"] if r["coords"]["pp"] == 0}
    for rank in first_stage:
        predicted = {r["bucket"] for r in rows if r["rank"] == rank and r["predicted"] is not None
                     and r["metric"] == "overlap.reduce_scatter.overlapped_fraction"}
        assert len(predicted) >= 3, (rank, predicted)


@pytest.mark.slow
@pytest.mark.timeout(DEMO_TIMEOUT + 60)
def test_oversubscribed_timings_are_said_once_not_judged(demo, run: Path) -> None:
    out = demo[1].stdout
    cores = manifest(run)["ranks"][0]["device"]["cores"]
    if cores is not None and cores >= 8:
        pytest.skip(f"{cores} cores: the demo's 8 ranks are not oversubscribed here")
    assert out.count("timings: 8 ranks share") == 1 and out.find("timings: 8 ranks") < out.find(" iteration ")
    result = json.loads((run / "ledger" / "reconciliation.json").read_text())
    assert len([m for m in result["missing"] if m.startswith("timings not judged")]) == 1
    timed = [r for r in result["rows"] if r["metric"].split(".")[0] in ("time", "pipeline", "overlap", "throughput")]
    assert timed and not [r for r in timed if r["verdict"] in ("ok", "warn", "off")]
