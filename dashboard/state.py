"""What every page shares: the runs root, the selected run, path safety, and the ledger's loaders behind one cache.

Pages name the ledger function that computes their data (`state.open_page("Memory", loaders.memory_timeline)`), so a
reader can follow a page to its data. Each function takes the run's RunView (ledger.present.loaders): the run is read
once per file signature and every page's loaders share that one reading (st.cache_resource). Their results are
cached by st.cache_data on (the function's qualified name, run path, the run's file signature, arguments). The
signature is the count,
total size and newest modification time of the run's files, so a run that is still writing (a new step, a rank's
manifest renamed into place) or a fresh `train-ledger reconcile` is read again, and an unchanged one never is.

Path safety: the only paths that come from the browser are run names (the run selector, the `?run=` query
parameter). Each is resolved (symlinks and `..` included) and must lie strictly under the resolved runs root;
anything else is refused before a file is opened.

Errors: a loader that fails on a broken run shows one error naming the run and the problem, once per page however
many loaders meet the same problem (`start_page` clears the record); `open_page` stops at the first loader that
fails, so the error stands under the title.

Progress: every load runs under st.spinner, which Streamlit shows only when the load takes longer than half a second,
that is when it is computed rather than cached; it says what is being computed (reconciling a run that has no
reconciliation.json yet takes seconds).
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any, Callable

import streamlit as st

from common.errors import InputError, UserError
from common.run_dir import LEDGER_DIR
from dashboard.launch import DEFAULT_ROOT, RUN_ENV, RUNS_ROOT_ENV
from ledger.present import dashboard_data, loaders
from ledger.reconcile.run import JSON_NAME

RUN_KEY = "run"  # the query parameter that opens a run: ?run=NAME
SELECTED = "selected_run"
SHOWN_ERRORS = "errors_shown"  # the errors this page has shown, so that each is shown once
RECONCILING = (loaders.load_reconciliation, loaders.load_summary, loaders.load_rows, loaders.memory_waterfall,
               dashboard_data.headline)  # the loaders that reconcile the run when it has no reconciliation.json


def runs_root() -> Path:
    return Path(os.environ.get(RUNS_ROOT_ENV, str(DEFAULT_ROOT))).resolve()


def resolve_run(name: str) -> Path:
    """The run directory a UI-supplied name points to; InputError unless it lies strictly under the runs root."""
    root = runs_root()
    path = (root / name).resolve()
    if path == root or not path.is_relative_to(root):
        raise InputError(name, f"not a run under the runs root {root}")
    return path


def signature(path: Path) -> tuple[int, int, int]:
    """(file count, total bytes, newest mtime in ns) of everything under `path`: changes whenever a file does."""
    count = size = newest = 0
    for folder, _, files in os.walk(path):
        for name in files:
            try:
                st_ = os.stat(os.path.join(folder, name))
            except FileNotFoundError:  # a temp file renamed away between listing and stat
                continue
            count, size, newest = count + 1, size + st_.st_size, max(newest, st_.st_mtime_ns)
    return count, size, newest


def _dir_signature(root: Path) -> tuple[tuple[str, int], ...]:
    """Modification times of the root and the folders two levels down: a run appearing or renaming its manifest
    into place changes one of them."""
    dirs = [root] + [p for p in root.glob("*") if p.is_dir()] + [p for p in root.glob("*/*") if p.is_dir()]
    return tuple((str(d), d.stat().st_mtime_ns) for d in dirs)


Loader = Callable[..., Any]  # loader(RunView, *args) -> plain values (ledger.present.loaders, .dashboard_data)


def _name(loader: Loader) -> str:
    return f"{loader.__module__}.{loader.__qualname__}"


@st.cache_resource(show_spinner=False, max_entries=64)
def _view(path: str, sig: tuple) -> loaders.RunView:
    """The run read once per signature, shared by every loader of every page (a RunView is read-only to them)."""
    return loaders.open_run(path)


@st.cache_data(show_spinner=False, max_entries=512)
def _cached(name: str, _loader: Loader, path: str, sig: tuple, args: tuple) -> Any:
    """`name` is the cache key for the function; `_loader` (unhashed, by Streamlit's underscore rule) is called."""
    return _loader(_view(path, sig), *args)


@st.cache_data(show_spinner=False, max_entries=16)
def _cached_runs(root: str, sig: tuple) -> list[dict[str, Any]]:
    return loaders.list_runs(root, lambda path: _view(str(path), signature(path)))


@st.cache_data(show_spinner=False, max_entries=64)
def ideal_schedule(pp: int, microbatches: int, vpp: int) -> dict[str, Any]:
    return dashboard_data.ideal_schedule(pp, microbatches, vpp)


@st.cache_data(show_spinner="Merging the per-rank traces into one Perfetto trace (aligning their clocks on shared "
               "collectives) ...", max_entries=4)
def _merged_trace(path: str, sig: tuple) -> tuple[dict[str, Any], bytes]:
    with tempfile.TemporaryDirectory() as tmp:  # never written under the runs root: the dashboard only reads there
        out = Path(tmp) / "merged.json.gz"
        info = dashboard_data.merged_trace(_view(path, sig), str(out))
        return info, out.read_bytes()


def merged_trace(run: str) -> tuple[dict[str, Any], bytes]:
    """The run's merged Perfetto trace (gzip JSON bytes) and what the export says about it; UserError if broken."""
    path = resolve_run(run)
    return _merged_trace(str(path), signature(path))


def list_runs() -> list[dict[str, Any]]:
    """Every run under the root, each with `rel`: its name relative to the root (what the UI passes around)."""
    root = runs_root()
    if not root.is_dir():
        return []
    runs = _cached_runs(str(root), _dir_signature(root))
    return [{**r, "rel": str(Path(r["path"]).relative_to(root))} for r in runs]


def progress_text(loader: Loader, run: str, path: Path) -> str:
    """What the spinner says while `loader` computes for `run`."""
    if loader in RECONCILING and not (path / LEDGER_DIR / JSON_NAME).is_file():
        return (f"Reconciling run {run}: formula vs inventory vs measurement, every rank and trace (it has no "
                f"{LEDGER_DIR}/{JSON_NAME} yet; `train-ledger reconcile` writes one) ...")
    return f"Reading run {run} ({loader.__name__.replace('_', ' ')}) ..."


def load(loader: Loader, run: str, *args: Any) -> Any:
    """A loader's result for the run named `run` (relative to the root); raises UserError for a broken run."""
    path = resolve_run(run)
    with st.spinner(progress_text(loader, run, path)):
        return _cached(_name(loader), loader, str(path), signature(path), args)


def show_error(text: str) -> None:
    """st.error, unless this page has shown the same text already."""
    shown = st.session_state.setdefault(SHOWN_ERRORS, set())
    if text not in shown:
        shown.add(text)
        st.error(text)


def guarded(loader: Loader, run: str, *args: Any) -> Any | None:
    """`load`, or None after an error naming the run and the problem (shown once): a broken run never stops the
    page."""
    try:
        return load(loader, run, *args)
    except UserError as exc:
        show_error(f"run {run}: {exc}")
    except Exception as exc:  # a reader's bug on some unforeseen file: show it for this run, keep the app alive
        show_error(f"run {run}: {loader.__name__} failed: {exc.__class__.__name__}: {exc}")
    return None


def start_page(title: str) -> None:
    """Every page's first line: its title, and a fresh record of the errors it has shown."""
    st.session_state[SHOWN_ERRORS] = set()
    st.title(title)


def open_page(title: str, *loaders: Loader) -> tuple[Any, ...]:
    """Every run page's opening: its title, the selected run, and each loader's data for it; the page stops here,
    under the title, when there is no run (with the explanation) or at the first loader that fails (with its
    error)."""
    start_page(title)
    run = current_run()
    if run is None:
        st.stop()
    data = []
    for loader in loaders:
        result = guarded(loader, run)
        if result is None:
            st.stop()
        data.append(result)
    return (run, *data)


def initial_run(runs: list[dict[str, Any]]) -> str | None:
    """The run to select first: `?run=` in the URL, else the command's --run, else the newest run."""
    names = [r["rel"] for r in runs]
    for wanted in (st.query_params.get(RUN_KEY), os.environ.get(RUN_ENV)):
        if wanted:
            try:
                rel = str(resolve_run(wanted).relative_to(runs_root()))
            except InputError as exc:
                st.warning(str(exc))
                continue
            if rel in names:
                return rel
    return names[0] if names else None


def select_run(runs: list[dict[str, Any]]) -> str | None:
    """The sidebar's run selector. The choice lives in a plain session key (SELECTED) that seeds the selector's
    index on every run, so it survives page switches and does not depend on the widget's own state."""
    names = [r["rel"] for r in runs]
    if not names:
        st.session_state.pop(SELECTED, None)
        return None
    if st.session_state.get(SELECTED) not in names:
        st.session_state[SELECTED] = initial_run(runs)
    labels = {r["rel"]: f"{r['rel']}  [{r.get('status') or 'error'}]" for r in runs}
    run = st.sidebar.selectbox("Run", names, index=names.index(st.session_state[SELECTED]), format_func=labels.get)
    st.session_state[SELECTED] = run
    return run


def timing_caveat(run: str) -> None:
    """The run's shared-cores caveat above a page's timings, when its CPU ranks outnumber their cores
    (ledger.evidence.run.cpu_sharing): the report sets those rows aside for the same reason, and a page must not
    read waits for a core as exposed communication or a bubble."""
    sharing = guarded(loaders.shared_cores, run)
    if sharing:
        st.warning(f"Timings here are not judged: {sharing}. The report shows them with verdict n/a for the same "
                   "reason; read them as this machine's, not the layout's.")


def current_run() -> str | None:
    """The run the sidebar selected (pages call this; None with an explanation when there is none)."""
    run = st.session_state.get(SELECTED)
    if run is None:
        st.info(f"No runs under {runs_root()}. Write one with `train-ledger demo` or `train-ledger train ... "
                "--run-dir RUN`, then reload.")
    return run
