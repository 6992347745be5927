"""The dashboard headless (streamlit.testing.v1.AppTest): every page over every kind of run, the widgets that drive
the filters and the comparison, path safety, and `train-ledger dashboard`'s argument handling.

AppTest quirk (Streamlit 1.67): after the first run it drops the entry script's own elements from its element tree
(the browser still shows them), so the sidebar's run selector is driven through the session key it reads and
writes (state.SELECTED); tests/test_dashboard_browser.py clicks the real one.
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("streamlit")
pytest.importorskip("plotly")
from streamlit.testing.v1 import AppTest  # noqa: E402

import cli.main as cli  # noqa: E402
from cli import dashboard as command  # noqa: E402
from common.errors import InputError  # noqa
from dashboard import state  # noqa: E402
from ledger.present import loaders  # noqa: E402
from ledger.present.headline import HEADLINES  # noqa: E402
from ledger.present.report_view import NSYS_COMMAND  # noqa: E402
from tests.fixtures.dashboard.runs import BROKEN, COMPLETE, make_runs_root  # noqa: E402

APP = Path(__file__).resolve().parents[1] / "dashboard" / "app.py"
PAGES = ["runs", "reconciliation", "memory", "pipeline", "overlap", "topology", "traces"]
TIMEOUT = 120  # 2 CPU cores shared with other test runs: generous, still bounded


@pytest.fixture(scope="module")
def runs_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    make_runs_root(root)
    return root


@pytest.fixture
def app(runs_root: Path, monkeypatch: pytest.MonkeyPatch) -> AppTest:
    monkeypatch.setenv(command.RUNS_ROOT_ENV, str(runs_root))
    monkeypatch.delenv(command.RUN_ENV, raising=False)
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    at.run()
    return at


def open_page(at: AppTest, page: str, run: str | None = None) -> AppTest:
    if run is not None:
        at.session_state[state.SELECTED] = run
    at.switch_page(f"pages/{page}.py").run()
    assert not at.exception, [e.value for e in at.exception]
    return at


def texts(elements) -> str:
    return "\n".join(str(e.value) for e in elements)


@pytest.mark.parametrize("page", PAGES)
def test_every_page_renders_the_complete_run_without_errors(app: AppTest, page: str) -> None:
    open_page(app, page, COMPLETE)
    assert not app.error, texts(app.error)
    assert app.title[0].value.lower() == page


@pytest.mark.parametrize("run", ["cpu", *BROKEN])
def test_every_page_survives_partial_and_broken_runs(app: AppTest, run: str) -> None:
    for page in PAGES:
        open_page(app, page, run)
        if run == "corrupt-manifest" and page != "runs":
            assert "corrupt JSON" in texts(app.error), page
        if run == "corrupt-trace" and page in ("reconciliation", "memory"):
            assert "not gzip" in texts(app.error) or "gzip" in texts(app.error), page


def test_crashed_run_says_what_is_missing(app: AppTest) -> None:
    open_page(app, "reconciliation", "crashed")
    missing = texts(app.caption)
    assert "run status is 'running'" in missing
    assert "no events for rank(s) 3" in missing
    assert "torn line" in missing


def test_empty_root_renders_every_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(command.RUNS_ROOT_ENV, str(tmp_path))
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    at.run()
    for page in PAGES:
        open_page(at, page)
        assert "No runs under" in texts(at.info), page


def headline_of(at: AppTest, run: str) -> dict[str, str]:
    """The Runs page's headline table of the selected run: figure -> value."""
    open_page(at, "runs", run)
    return dict(at.dataframe[1].value.itertuples(index=False))


def test_runs_page_lists_every_run_and_the_selected_runs_headline(app: AppTest) -> None:
    table = app.dataframe[0].value.set_index("run")
    assert set(table.index) == {COMPLETE, "cpu", *BROKEN}
    assert table.loc[COMPLETE, "status"] == "complete"
    assert table.loc[COMPLETE, "layout"] == "8 = TP2 x CP1 x DP2 x PP2"
    assert table.loc["crashed", "status"] == "running"
    (warning,) = app.warning  # the broken runs and their errors, once, above the table
    assert "**corrupt-manifest**" in warning.value and "corrupt JSON" in warning.value
    assert "**corrupt-trace**" in warning.value and "gzip" in warning.value
    assert "error" not in table.columns
    assert not table.isin(["None", None]).any().any()
    # (p-1)/(m+p-1) with p=2, m=4, as the fixture is built; measured by the timers
    assert headline_of(app, COMPLETE)["pipeline bubble"] == "20.00% · measured"
    assert list(headline_of(app, COMPLETE)) == [h.label for h in HEADLINES]


def test_runs_page_labels_figures_predicted_or_measured(app: AppTest) -> None:
    """The GPU run measures its peak (memory_stats); the CPU run cannot, so its peak is the formula's."""
    assert headline_of(app, COMPLETE)["peak memory"].endswith(" · measured")
    cpu = headline_of(app, "cpu")
    assert cpu["peak memory"].endswith(" · predicted")
    assert cpu["bytes/param"].endswith(" · engine inventory")
    assert cpu["MFU"] == "—"  # no GPU peak to divide by: no figure, and no label
    assert "**measured**" in texts(app.caption) and "**predicted**" in texts(app.caption)


def test_comparison_puts_two_runs_side_by_side(app: AppTest) -> None:
    app.multiselect(key="compare").set_value([COMPLETE, "cpu"]).run()
    assert not app.exception
    side = app.dataframe[2].value
    assert list(side.columns) == [COMPLETE, "cpu", "same"]
    assert side.loc["layout", COMPLETE] == "8 = TP2 x CP1 x DP2 x PP2"
    assert side.loc["layout", "cpu"] == "4 = TP2 x CP1 x DP2 x PP1"
    assert not side.loc["layout", "same"]
    assert {m.label.split(" · ")[0] for m in app.metric} == {h.label for h in HEADLINES}
    assert "peak memory · measured" in {m.label for m in app.metric}


def test_reconciliation_filters_by_verdict_rank_and_metric(app: AppTest) -> None:
    open_page(app, "reconciliation", COMPLETE)
    everything = app.dataframe[0].value
    assert len(everything) > 50 and set(everything["verdict"]) >= {"ok", "n/a"}

    app.multiselect(key="rec_verdict").set_value(["off"]).run()
    off = app.dataframe[0].value
    assert 0 < len(off) < len(everything) and set(off["verdict"]) == {"off"}

    app.multiselect(key="rec_verdict").set_value([]).run()
    app.multiselect(key="rec_family").set_value(["memory"]).run()
    app.multiselect(key="rec_rank").set_value([5]).run()
    rows = app.dataframe[0].value
    assert set(rows["rank"]) == {"5"} and all(rows["metric"].str.startswith("memory."))
    app.multiselect(key="rec_metric").set_value(["memory.bytes_per_param"]).run()
    assert len(app.dataframe[0].value) == 1
    assert "static bytes" in texts(app.info)  # the chosen row's explanation


def figure_specs(at: AppTest) -> str:
    return "\n".join(chart.proto.spec for chart in at.get("plotly_chart"))


def axis_titles(at: AppTest) -> list[tuple[str, str]]:
    """(x title, y title) of every Plotly chart on the page."""
    out = []
    for chart in at.get("plotly_chart"):
        layout = json.loads(chart.proto.spec)["layout"]
        out.append(tuple((layout.get(axis, {}).get("title") or {}).get("text", "") for axis in ("xaxis", "yaxis")))
    return out


@pytest.mark.parametrize("page", ["memory", "pipeline", "overlap"])
def test_every_chart_names_its_axes_with_units(app: AppTest, page: str) -> None:
    open_page(app, page, COMPLETE)
    titles = axis_titles(app)
    assert titles, page
    for x, y in titles:
        assert x and y and not {x, y} & {"value", "variable", "ms", "bytes"}, (page, x, y)
    units = re.compile(r"\((B|KiB|MiB|GiB|ns|µs|ms|s|%)\)")
    assert any(units.search(x) or units.search(y) for x, y in titles), titles
    assert not re.search(r'"(value|variable)"', figure_specs(app))  # plotly's names for melted columns


def test_overlap_page_names_the_parts_of_a_collective(app: AppTest) -> None:
    open_page(app, "overlap", COMPLETE)
    specs = figure_specs(app)
    assert "beside compute" in specs and "exposed" in specs and "part of the collective" in specs
    assert re.search(r"mean time per step \((ns|µs|ms|s)\)", specs)
    table = app.dataframe[0].value
    assert list(table.columns) == ["bucket", "steps", "duration", "beside compute", "exposed"]
    assert all(re.fullmatch(r"[\d.,]+ (ns|µs|ms|s)", t) for t in table["duration"])


@pytest.mark.parametrize("run", ["corrupt-manifest", "corrupt-trace"])
def test_a_broken_runs_error_is_shown_once_under_the_title(app: AppTest, run: str) -> None:
    for page in PAGES[1:]:
        open_page(app, page, run)
        assert len(app.error) <= 1, (page, texts(app.error))
        if run == "corrupt-manifest":
            assert len(app.error) == 1, page


def test_reconciliation_page_writes_figures_in_their_units(app: AppTest) -> None:
    open_page(app, "reconciliation", COMPLETE)
    app.multiselect(key="rec_metric").set_value(["memory.peak_allocated", "pipeline.bubble_of_wall_time"]).run()
    table = app.dataframe[0].value.set_index("metric")
    assert all(re.fullmatch(r"[\d.]+ (KiB|MiB|GiB)", v) for v in table.loc["memory.peak_allocated", "measured"])
    assert set(table.loc["pipeline.bubble_of_wall_time", "measured"]) == {"20.00%"}
    assert set(table.loc["pipeline.bubble_of_wall_time", "predicted by"]) == {"formula"}
    assert not table.isin(["None", "nan", None]).any().any() and not table.isna().any().any()


def test_a_computation_shows_what_it_is_doing(runs_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reconciling a run that has no reconciliation.json takes seconds: the spinner says so."""
    monkeypatch.setenv(command.RUNS_ROOT_ENV, str(runs_root))
    path = state.resolve_run(COMPLETE)
    assert state.progress_text(loaders.load_rows, COMPLETE, path).startswith(f"Reconciling run {COMPLETE}:")
    assert state.progress_text(loaders.topology, COMPLETE, path) == f"Reading run {COMPLETE} (topology) ..."


def test_memory_and_overlap_widgets_switch_rank(app: AppTest) -> None:
    open_page(app, "memory", COMPLETE)
    assert "rank 0: where the bytes are" in figure_specs(app)
    app.selectbox(key="mem_rank").set_value(6).run()
    assert not app.exception and not app.error
    assert "rank 6: where the bytes are" in figure_specs(app)
    open_page(app, "overlap", COMPLETE)
    app.selectbox(key="ov_rank").set_value(3).run()
    app.selectbox(key="ov_step").set_value(2).run()
    assert not app.exception and not app.error
    assert "rank 3, step 2" in figure_specs(app)


def test_traces_page_merges_and_offers_the_download(app: AppTest) -> None:
    open_page(app, "traces", COMPLETE)
    assert len(app.dataframe[0].value) == 8  # one trace per rank
    app.button(key="tr_merge").click().run()
    assert not app.exception and not app.error, texts(app.error)
    assert "events from ranks [0, 1, 2, 3, 4, 5, 6, 7]" in texts(app.success)
    shown = " ".join(texts(app.markdown).replace("\\\n", " ").split())  # its code block wraps lines with "\\"
    assert " ".join(NSYS_COMMAND.split()) in shown  # the report's command, from one place


def test_run_names_from_the_ui_cannot_leave_the_root(runs_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(command.RUNS_ROOT_ENV, str(runs_root))
    assert state.resolve_run(COMPLETE) == (runs_root / COMPLETE).resolve()
    outside = runs_root.parent / "outside"
    outside.mkdir(exist_ok=True)
    (runs_root / "link-out").symlink_to(outside)
    for bad in ("..", "../outside", "/etc", "link-out", ".", f"{COMPLETE}/../../outside"):
        with pytest.raises(InputError):
            state.resolve_run(bad)


def test_query_parameter_outside_the_root_is_refused(runs_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(command.RUNS_ROOT_ENV, str(runs_root))
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    at.query_params[state.RUN_KEY] = "../../etc"
    at.run()
    assert not at.exception
    assert "not a run under the runs root" in texts(at.warning)
    assert at.session_state[state.SELECTED] in {COMPLETE, "cpu", *BROKEN}


def test_command_opens_the_run_it_is_given(runs_root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(command.RUNS_ROOT_ENV, str(runs_root))
    monkeypatch.setenv(command.RUN_ENV, "cpu")
    at = AppTest.from_file(str(APP), default_timeout=TIMEOUT)
    at.run()
    assert at.session_state[state.SELECTED] == "cpu"


def test_dashboard_command_binds_localhost_headless() -> None:
    argv = command.streamlit_argv(command.app_path(), "127.0.0.1", 8501)
    assert argv[1:4] == ["-m", "streamlit", "run"] and argv[4].endswith("dashboard/app.py")
    flags = dict(zip(argv[5::2], argv[6::2]))
    assert flags["--server.address"] == "127.0.0.1" and flags["--server.headless"] == "true"


@pytest.mark.parametrize("args, message", [
    (["--runs-root", "/nonexistent/runs"], "runs root does not exist"),
    (["--runs-root", __file__], "runs root is not a directory"),
    (["--port", "0", "--runs-root", "."], "--port 0"),
    (["--run", "../elsewhere", "--runs-root", "."], "is not under the runs root"),
    (["--bogus"], "unrecognized arguments"),
])
def test_dashboard_command_bad_input_is_one_line_exit_2(args: list[str], message: str,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["dashboard", *args]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_a_cpu_runs_pages_say_what_a_cpu_measures(app: AppTest) -> None:
    """The synthetic CPU run (4 ranks, cores not recorded): no caption speaks of NVML, reserved or outside-PyTorch
    memory; the timeline is called the process RSS, not read as a leak; the timing pages carry the shared-cores
    caveat the report states."""
    open_page(app, "memory", "cpu")
    captions = texts(app.caption)
    assert "NVML" not in captions and "reserved" not in captions and "outside PyTorch" not in captions
    assert "resident memory (RSS)" in captions and "no leak by itself" in captions
    for page in ("overlap", "pipeline"):
        open_page(app, page, "cpu")
        assert "Timings here are not judged: 4 ranks share host" in texts(app.warning), page
    open_page(app, "overlap", COMPLETE)
    assert "Timings here are not judged" not in texts(app.warning)  # GPU ranks share no cores


def test_the_overlap_pages_means_are_over_the_reports_steps(app: AppTest) -> None:
    from ledger.evidence.steps import step_list

    open_page(app, "overlap", COMPLETE)
    intervals = loaders.bucket_intervals(loaders.open_run(state.resolve_run(COMPLETE)))
    counted = sorted({i["step"] for i in intervals if i["rank"] == 0 and i["counted"]})
    every = sorted({i["step"] for i in intervals if i["rank"] == 0})
    assert counted and counted != every  # the run's first step is left out, as the report leaves it out
    assert f"mean over {step_list(counted)}, the steps the report's overlap rows count" in figure_specs(app)
    rows = [r for r in loaders.load_rows(loaders.open_run(state.resolve_run(COMPLETE)))
            if r["metric"].endswith("overlapped_fraction") and r["rank"] == 0 and r["source"] == "timers"]
    assert rows and all(f"mean of {step_list(counted)} (timers)" in r["explanation"] for r in rows)
