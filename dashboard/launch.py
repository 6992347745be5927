"""How the dashboard is started, without importing Streamlit: where its app file is, and the two environment
variables that carry the runs root and the run to open first from `train-ledger dashboard` into the server
(Streamlit keeps its own command line for its own flags). dashboard.state reads them; the CLI sets them."""
from __future__ import annotations

from pathlib import Path

RUNS_ROOT_ENV = "TRAIN_LEDGER_RUNS_ROOT"
RUN_ENV = "TRAIN_LEDGER_RUN"
DEFAULT_ROOT = Path("runs/out")


def app_path() -> Path:
    return Path(__file__).resolve().parent / "app.py"
