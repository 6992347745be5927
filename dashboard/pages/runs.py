"""Runs: every run under the root with its status, framework, layout, config and headline figures; two runs side by
side. A run that cannot be read is a row with its error, never a failed page."""
from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from common.errors import UserError
from common.units import human
from dashboard import state
from ledger import dashboard_data, loaders
from ledger.headline import HEADLINES

st.title("Runs")
runs = state.list_runs()
if not runs:
    state.current_run()
    st.stop()


def describe(run: dict[str, Any]) -> dict[str, Any]:
    """One table row: identity from the listing, then layout, config and headline figures, or the run's error."""
    out: dict[str, Any] = {"run": run["rel"], "status": run.get("status"), "framework": run.get("framework"),
                           "reconciled": run.get("reconciled"), "started": run.get("started")}
    error = run.get("error")
    if error is None:
        try:
            manifest = state.load(loaders.load_manifest, run["rel"])
            out.update(layout=dashboard_data.layout_text(manifest), config=dashboard_data.config_text(manifest))
            for name, fig in state.load(dashboard_data.headline, run["rel"]).items():
                out[name] = human(fig["value"], fig["unit"])
        except UserError as exc:
            error = str(exc)
    out["error"] = error or ""
    return out


FIGURES = [h.label for h in HEADLINES]
COLUMNS = ["run", "status", "layout", *FIGURES, "framework", "config", "reconciled", "started", "error"]
table = pd.DataFrame([describe(r) for r in runs]).reindex(columns=COLUMNS)
st.dataframe(table, hide_index=True, width="stretch")
broken = table[table["error"].fillna("") != ""]
if len(broken):
    st.warning(f"{len(broken)} run(s) could not be read in full; their error is in the last column.")

st.subheader("Compare two runs")
pair = st.multiselect("Runs to compare", [r["rel"] for r in runs], max_selections=2, key="compare")
if len(pair) == 2:
    rows = {name: table.set_index("run").loc[name] for name in pair}
    fields = ["status", "framework", "layout", "config", *FIGURES, "error"]
    side = pd.DataFrame({name: [rows[name].get(f, "") for f in fields] for name in pair}, index=fields)
    side["same"] = side[pair[0]] == side[pair[1]]
    st.dataframe(side, width="stretch")
    for column, name in zip(st.columns(2), pair):
        with column:
            st.markdown(f"**{name}**")
            figures = state.guarded(dashboard_data.headline, name)
            for label, fig in (figures or {}).items():
                st.metric(label, human(fig["value"], fig["unit"]), help=fig["source"])
elif pair:
    st.caption("Pick a second run.")
