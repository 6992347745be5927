"""Pipeline: one pipeline's measured per-stage timeline (forward / backward / idle) beside the ideal schedule the
engine's plan gives on equal-cost cells, and the bubble each stage measured against the closed form."""
from __future__ import annotations

import pandas as pd
import plotly.express as px
import streamlit as st

from dashboard import state
from ledger import dashboard_data, loaders

KIND_COLOURS = {"forward": "#42a5f5", "backward": "#ef6c00", "idle": "#e0e0e0"}

run, shape, topo = state.open_page("Pipeline", dashboard_data.pipeline_shape, loaders.topology)
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
        measured["ms"] = (measured["end"] - measured["start"]) * 1e3
        measured["label"] = measured["microbatch"].map(lambda m: "" if pd.isna(m) else str(int(m)))
        fig = px.bar(measured, base=measured["start"] * 1e3, x="ms", y="stage", color="kind", orientation="h",
                     text="label", color_discrete_map=KIND_COLOURS, category_orders={"kind": list(KIND_COLOURS)})
        fig.update_layout(xaxis_title="ms from the step's first forward", yaxis_autorange="reversed", height=320)
        st.plotly_chart(fig, width="stretch")
with b:
    st.subheader("Ideal schedule")
    cells = pd.DataFrame(ideal["cells"])
    cells["stage"] = "stage " + cells["stage"].astype(str)
    cells["width"] = 1
    fig = px.bar(cells, base="slot", x="width", y="stage", color="kind", orientation="h", text="label",
                 color_discrete_map=KIND_COLOURS)
    fig.update_layout(xaxis_title="clock (one cell per forward or backward)", yaxis_autorange="reversed",
                      height=320)
    st.plotly_chart(fig, width="stretch")
st.caption(f"p={shape['pp']}, m={shape['microbatches']}, V={shape['vpp']}: ideal chart bubble "
           f"{ideal['bubble_fraction']:.2%}, closed form {ideal['analytic_bubble_fraction']:.2%}")

st.subheader("Bubble per stage: measured vs formula")
rows = state.guarded(loaders.load_rows, run)
bubbles = pd.DataFrame([r for r in rows or [] if r["metric"].startswith("pipeline.bubble")])
if bubbles.empty:
    st.info("No bubble rows: the run has no forward / backward timers.")
else:
    bubbles = bubbles[bubbles["rank"].isin(members)]
    long = bubbles.melt(id_vars=["metric", "stage", "rank"], value_vars=["predicted", "measured"], var_name="column",
                        value_name="fraction")
    long["stage"] = "stage " + long["stage"].astype(str)
    st.plotly_chart(px.bar(long, x="stage", y="fraction", color="column", facet_col="metric", barmode="group"),
                    width="stretch")
    st.dataframe(bubbles[["metric", "rank", "stage", "predicted", "measured", "verdict", "explanation"]],
                 hide_index=True)
