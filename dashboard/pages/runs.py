"""Runs: every run under the root with its status, framework, layout, config and headline figures, each figure
labelled with where it comes from (measured, the engine's inventory, or predicted); two runs side by side. A run
that cannot be read is a row of the table and one warning that names it and its error, never a failed page."""
from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

from common.errors import UserError
from dashboard import state
from ledger import dashboard_data, loaders
from ledger import format as units
from ledger.headline import HEADLINES

# ledger.headline's figure source ends with the column the value came from; how the page names each
KINDS = {"measured": "measured", "inventory": "engine inventory", "predicted": "predicted"}
KIND_NOTE = ("Each headline figure says where it comes from: **measured** (memory_stats, NVML, timers, traces), "
             "**engine inventory** (the engine's record of its own tensors) or **predicted** (the formulas and the "
             "time model), the first of these the run has; — where the run has no row for it.")


def kind(fig: dict[str, Any]) -> str:
    column = fig["source"].rpartition(", ")[2]
    return KINDS.get(column, column)


def figure_text(fig: dict[str, Any]) -> str:
    """'12.01 B/param · engine inventory'; '—' when the run has no row for the figure."""
    if fig["value"] is None:
        return units.DASH
    return f"{units.value(fig['value'], fig['unit'])} · {kind(fig)}"


state.start_page("Runs")
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
                out[name] = figure_text(fig)
        except UserError as exc:
            error = str(exc)
    out["error"] = error or ""
    return out


FIGURES = [h.label for h in HEADLINES]
COLUMNS = ["run", "status", "layout", *FIGURES, "framework", "config", "reconciled", "started"]
described = pd.DataFrame([describe(r) for r in runs])
broken = described[described["error"] != ""]
if len(broken):
    st.warning(f"{len(broken)} run(s) could not be read in full:\n"
               + "\n".join(f"* **{row.run}**: {row.error}" for row in broken.itertuples()))
table = described.reindex(columns=COLUMNS).fillna(units.DASH)
st.caption(KIND_NOTE)
st.dataframe(table, hide_index=True, width="stretch")

st.subheader("Compare two runs")
pair = st.multiselect("Runs to compare", [r["rel"] for r in runs], max_selections=2, key="compare")
if len(pair) == 2:
    rows = {name: described.set_index("run").loc[name].fillna(units.DASH) for name in pair}
    fields = ["status", "framework", "layout", "config", *FIGURES, "error"]
    side = pd.DataFrame({name: [rows[name].get(f, "") for f in fields] for name in pair}, index=fields)
    side["same"] = side[pair[0]] == side[pair[1]]
    st.dataframe(side, width="stretch")
    for column, name in zip(st.columns(2), pair):
        with column:
            st.markdown(f"**{name}**")
            figures = state.guarded(dashboard_data.headline, name)
            for label, fig in (figures or {}).items():
                st.metric(f"{label} · {kind(fig)}" if fig["value"] is not None else label,
                          units.value(fig["value"], fig["unit"]), help=fig["source"])
elif pair:
    st.caption("Pick a second run.")
