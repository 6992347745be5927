"""Pipeline: one pipeline's measured per-stage timeline (forward / backward / idle) beside the ideal schedule the
engine's plan gives on equal-cost cells, and the bubble each stage measured against the closed form."""
from __future__ import annotations

import pandas as pd
import plotly.express as px
import streamlit as st

from dashboard import state, tables
from ledger.present import dashboard_data, loaders, units
from ledger.present.row_groups import group

KIND_COLOURS = {"forward": "#42a5f5", "backward": "#ef6c00", "idle": "#e0e0e0"}

run, shape, topo = state.open_page("Pipeline", dashboard_data.pipeline_shape, loaders.topology)
state.timing_caveat(run)
if shape["pp"] < 2:
    st.info(f"This run has pipeline size {shape['pp']}: there is no pipeline schedule to draw.")
    st.stop()

columns = sorted({(r["coords"].get("tp", 0), r["coords"].get("dp", 0)) for r in topo["ranks"]})
left, right = st.columns(2)
column = left.selectbox("Pipeline (tp, dp)", columns, format_func=lambda c: f"tp{c[0]} dp{c[1]}", key="pp_column")
step = right.number_input("Step (0 = the last with timers)", min_value=0, value=0, step=1, key="pp_step")
members = {r["rank"] for r in topo["ranks"] if (r["coords"].get("tp", 0), r["coords"].get("dp", 0)) == column}
slots = state.guarded(loaders.stage_timeline, run, int(step) or None)
if slots is None:
    st.stop()


def with_idle(bars: list[dict]) -> list[dict]:
    """The measured bars plus an idle bar for every gap inside the pipeline's span, per stage."""
    if not bars:
        return []
    lo, hi = min(b["start"] for b in bars), max(b["end"] for b in bars)
    out = list(bars)
    for stage in {b["stage"] for b in bars}:
        t = lo
        for b in sorted((b for b in bars if b["stage"] == stage), key=lambda b: b["start"]):
            if b["start"] > t:
                out.append({**b, "kind": "idle", "microbatch": None, "start": t, "end": b["start"]})
            t = max(t, b["end"])
        if t < hi:
            out.append({"rank": None, "stage": stage, "kind": "idle", "microbatch": None, "start": t, "end": hi})
    return out


measured = pd.DataFrame(with_idle([s for s in slots if s["rank"] in members]))
ideal = state.ideal_schedule(shape["pp"], shape["microbatches"], shape["vpp"])
a, b = st.columns(2)
with a:
    st.subheader("Measured")
    if measured.empty:
        st.info("No forward / backward timers for this pipeline and step (run with --timers).")
    else:
        measured["stage"] = "stage " + measured["stage"].astype(str)
        divisor, unit = units.axis_scale(measured["end"].max(), "s")
        measured["from"] = measured["start"] / divisor
        measured["length"] = (measured["end"] - measured["start"]) / divisor
        measured["duration"] = (measured["end"] - measured["start"]).map(units.duration)
        measured["label"] = measured["microbatch"].map(lambda m: "" if pd.isna(m) else str(int(m)))
        fig = px.bar(measured, base="from", x="length", y="stage", color="kind", orientation="h", text="label",
                     color_discrete_map=KIND_COLOURS, category_orders={"kind": list(KIND_COLOURS)},
                     hover_data={"duration": True, "length": False, "from": False}, labels={"kind": "range"})
        fig.update_layout(xaxis_title=f"time from the step's first forward ({unit})", yaxis_title="pipeline stage",
                          yaxis_autorange="reversed", height=320)
        st.plotly_chart(fig, width="stretch")
with b:
    st.subheader("Ideal schedule")
    cells = pd.DataFrame(ideal["cells"])
    cells["stage"] = "stage " + cells["stage"].astype(str)
    cells["width"] = 1
    fig = px.bar(cells, base="slot", x="width", y="stage", color="kind", orientation="h", text="label",
                 color_discrete_map=KIND_COLOURS)
    fig.update_layout(xaxis_title="clock (one cell per forward or backward)", yaxis_title="pipeline stage",
                      yaxis_autorange="reversed", height=320)
    st.plotly_chart(fig, width="stretch")
st.caption(f"p={shape['pp']}, m={shape['microbatches']}, V={shape['vpp']}: ideal chart bubble "
           f"{units.percent(ideal['bubble_fraction'])}, closed form "
           f"{units.percent(ideal['analytic_bubble_fraction'])}. What to look for: the grey idle time of the measured "
           "stages against the ideal schedule's empty cells.")


def bubble_chart(bubbles: pd.DataFrame):
    """Per stage and convention: the textbook formula's, the time model's and the measured bubble, in percent;
    None when no row has a figure."""
    records = []
    for r in bubbles.itertuples():
        convention = "idle / pipeline span" if "of_wall_time" in r.metric else "idle / busy"
        predictor = "time model" if r.metric.endswith(".model") else "textbook formula"
        for figure, value in ((predictor, r.predicted), ("measured", r.measured)):
            if pd.notna(value):
                records.append({"stage": f"stage {r.stage}", "rank": r.rank, "convention": convention,
                                "figure": figure, "bubble": value * 100})
    if not records:
        return None
    long = pd.DataFrame(records).drop_duplicates(["stage", "rank", "convention", "figure"])
    fig = px.bar(long, x="stage", y="bubble", color="figure", facet_col="convention", barmode="group",
                 hover_data={"rank": True}, labels={"bubble": "bubble (%)", "stage": "pipeline stage",
                                                    "figure": "figure", "convention": "bubble as"})
    return fig.for_each_annotation(lambda a: a.update(text=a.text.replace("bubble as=", "bubble as ")))


st.subheader("Bubble per stage: measured vs formula and time model")
rows = state.guarded(loaders.load_rows, run)
bubbles = pd.DataFrame([r for r in rows or [] if r["metric"].startswith("pipeline.bubble")])
if bubbles.empty:
    st.info("No bubble rows: the run has no forward / backward timers.")
else:
    bubbles = bubbles[bubbles["rank"].isin(members)]
    chart = bubble_chart(bubbles)
    if chart is None:
        st.info("The bubble rows of this pipeline have neither a prediction nor a measurement.")
    else:
        st.plotly_chart(chart, width="stretch")
    st.caption("What to look for: the measured bubble against the textbook formula (equal stages, no "
               "communication) and the time model (each stage's own times, P2P transfers); a row's explanation "
               "names the term that moves it.")
    table = bubbles[["metric", "rank", "stage", "predicted", "measured", "verdict", "explanation"]].copy()
    for column in ("predicted", "measured"):
        table[column] = table[column].map(units.percent)
    tables.table(table, wide="explanation")
    st.markdown("\n".join(f"- **{line.metric}** ({line.where()}): {units.plain(line.explanation())}"
                           for line in group(bubbles.to_dict("records"))))
