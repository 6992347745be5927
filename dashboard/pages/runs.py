"""Runs: every run under the root with its status, layout and framework; the selected run's config and headline
figures, each labelled with where it comes from (measured, the engine's inventory, or predicted); two runs side by
side; the selected run's loss curve, joined across a kill and resume with the run it resumed from
(ledger.present.dashboard_data.loss_curve), a dashed marker where it resumed. A run that cannot be read is a row of
the table and one warning that names it and its error, never a failed page."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from common.errors import UserError
from dashboard import state, tables
from ledger.present import dashboard_data, units
from ledger.present.headline import HEADLINES

# ledger.present.headline's figure source ends with the column the value came from; how the page names each
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
            out.update(layout=state.load(dashboard_data.layout_text, run["rel"]),
                       config=state.load(dashboard_data.config_text, run["rel"]))
            for name, fig in state.load(dashboard_data.headline, run["rel"]).items():
                out[name] = figure_text(fig)
        except UserError as exc:
            error = str(exc)
    out["error"] = error or ""
    return out


FIGURES = [h.label for h in HEADLINES]
COLUMNS = ["run", "status", "layout", "framework", "reconciled", "started"]
described = pd.DataFrame([describe(r) for r in runs])
broken = described[described["error"] != ""]
if len(broken):
    st.warning(f"{len(broken)} run(s) could not be read in full:\n"
               + "\n".join(f"* **{row.run}**: {row.error}" for row in broken.itertuples()))
tables.table(described.reindex(columns=COLUMNS).fillna(units.DASH))

selected = state.current_run()
if selected is not None and selected in set(described["run"]):
    chosen = described.set_index("run").loc[selected].reindex(["config", *FIGURES]).fillna(units.DASH)
    st.subheader(f"Headline of run {selected}")
    st.caption(f"config: {chosen['config']}. {KIND_NOTE}")
    tables.table(pd.DataFrame({"figure": FIGURES, "value": [chosen[f] for f in FIGURES]}))

st.subheader("Compare two runs")
pair = st.multiselect("Runs to compare", [r["rel"] for r in runs], max_selections=2, key="compare")
if len(pair) == 2:
    rows = {name: described.set_index("run").loc[name].fillna(units.DASH) for name in pair}
    fields = ["status", "framework", "layout", "config", *FIGURES, "error"]
    side = pd.DataFrame({name: [rows[name].get(f, "") for f in fields] for name in pair}, index=fields)
    side["same"] = side[pair[0]] == side[pair[1]]
    tables.table(side)
    for column, name in zip(st.columns(2), pair):
        with column:
            st.markdown(f"**{name}**")
            figures = state.guarded(dashboard_data.headline, name)
            for label, fig in (figures or {}).items():
                st.metric(f"{label} · {kind(fig)}" if fig["value"] is not None else label,
                          units.value(fig["value"], fig["unit"]), help=fig["source"])
elif pair:
    st.caption("Pick a second run.")


def run_name(path: str) -> str:
    """A run directory as the sidebar names it (relative to the runs root), or its full path outside the root."""
    resolved = Path(path).resolve()
    root = state.runs_root()
    return str(resolved.relative_to(root)) if resolved.is_relative_to(root) else path


def loss_chart(curve: dict[str, Any]) -> go.Figure:
    """One line over every iteration (the earlier runs' steps, then this run's), each point naming its run, and a
    dashed vertical marker at each iteration a run resumed from."""
    steps = curve["steps"]
    fig = go.Figure(go.Scatter(x=[s["iteration"] for s in steps], y=[s["loss"] for s in steps], mode="lines+markers",
                               customdata=[run_name(s["run"]) for s in steps], name="loss",
                               hovertemplate="iteration %{x}: loss %{y:.6g}<br>run %{customdata}<extra></extra>"))
    for resume in curve["resumes"]:
        fig.add_vline(x=resume["iteration"], line_dash="dash", line_color="#6a1b9a",
                      annotation_text=f"resumed from iteration {resume['iteration']}", annotation_position="top")
    fig.update_layout(xaxis_title="iteration", yaxis_title="lm loss (global batch mean)", showlegend=False,
                      height=380)
    return fig


st.subheader("Loss")
curve = state.guarded(dashboard_data.loss_curve, selected) if selected is not None else None
if curve is not None and curve["steps"]:
    st.plotly_chart(loss_chart(curve), width="stretch")
    sources = [f"iterations up to {r['iteration']} from run {run_name(r['from_run'])}" for r in curve["resumes"]
               if r["joined"]]
    st.caption(f"Run {selected}: the loss of every iteration" + (f", {'; '.join(sources)} (the run that saved the "
               "checkpoint it resumed from)" if sources else "") + ". What to look for: a resumed run continues "
               "the curve where the earlier run saved; a jump at the marker means the resume did not restore the "
               "state.")
    for note in curve["notes"]:
        st.warning(note)
elif curve is not None:
    st.info(f"Run {selected} has no step with a loss yet.")
