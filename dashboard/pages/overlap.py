"""Overlap: each DP bucket's collective drawn over the rank's compute in one step, and the time each bucket left
exposed (no compute beside it), as the ledger's overlap rows compute it from the timers. Times are written by
ledger.present.units and every axis names its unit."""
from __future__ import annotations

import pandas as pd
import plotly.express as px
import streamlit as st

from dashboard import state, tables
from ledger.evidence.steps import step_list
from ledger.present import dashboard_data, loaders, units

PARTS = {"overlapped": "beside compute", "exposed": "exposed"}  # a collective's time, split by what ran beside it

run, intervals = state.open_page("Overlap", loaders.bucket_intervals)
if not intervals:
    st.info("No DP bucket timers in this run (run with --timers; buckets exist with DP > 1).")
    st.stop()

state.timing_caveat(run)
frame = pd.DataFrame(intervals)
left, right = st.columns(2)
rank = left.selectbox("Rank", sorted(frame["rank"].unique()), key="ov_rank")
steps = sorted(frame.loc[frame["rank"] == rank, "step"].unique())
step = right.selectbox("Step", steps, index=len(steps) - 1, key="ov_step")

timing = state.guarded(dashboard_data.rank_timing, run, int(rank), int(step))
if timing:
    bars = pd.DataFrame(timing)
    base = bars["start"].min()
    divisor, unit = units.axis_scale(bars["end"].max() - base, "s")
    bars["timer"] = bars.apply(lambda t: t["name"] if pd.notna(t["bucket"]) else t["category"], axis=1)
    bars["from"] = (bars["start"] - base) / divisor
    bars["length"] = (bars["end"] - bars["start"]) / divisor
    bars["duration"] = (bars["end"] - bars["start"]).map(units.duration)
    fig = px.bar(bars, base="from", x="length", y="timer", color="category", orientation="h", hover_name="name",
                 hover_data={"duration": True, "length": False, "from": False, "timer": False},
                 labels={"category": "kind of range"})
    fig.update_layout(title=f"rank {rank}, step {step}", xaxis_title=f"time from the step's first timer ({unit})",
                      yaxis_title="timer (buckets by name)", height=160 + 28 * bars["timer"].nunique())
    st.plotly_chart(fig, width="stretch")
    st.caption("What to look for: a bucket's collective bar that lies beside forward / backward bars is hidden by "
               "compute; one that sticks out past the last backward is time the step waits for.")

st.subheader("Exposed time per bucket")
mine = frame[(frame["rank"] == rank) & frame["counted"]].assign(duration=lambda f: f["end"] - f["start"])
per_bucket = mine.groupby(["op", "bucket"], as_index=False).agg(
    duration=("duration", "mean"), overlapped=("overlapped", "mean"), exposed=("exposed", "mean"),
    steps=("step", "nunique"))
per_bucket["bucket"] = per_bucket["op"] + " bucket " + per_bucket["bucket"].astype(str)
divisor, unit = units.axis_scale(per_bucket["duration"].max(), "s")
long = per_bucket.melt(id_vars=["bucket"], value_vars=list(PARTS), var_name="part", value_name="seconds")
long["part"] = long["part"].map(PARTS)
long["time"] = long["seconds"] / divisor
long["exact"] = long["seconds"].map(units.duration)
fig = px.bar(long, x="bucket", y="time", color="part", hover_data={"exact": True, "time": False},
             labels={"bucket": "bucket collective", "time": f"mean time per step ({unit})",
                     "part": "part of the collective", "exact": "time"},
             color_discrete_map={"beside compute": "#43a047", "exposed": "#e53935"})
counted = sorted(mine["step"].unique())
fig.update_layout(title=f"rank {rank}, mean over {step_list(counted)}, the steps the report's overlap rows count")
st.plotly_chart(fig, width="stretch")
st.caption("What to look for: red is communication no compute hid; with --overlap-grad-reduce only the last bucket "
           "of the backward should have much of it.")
table = per_bucket[["bucket", "steps"]].assign(**{
    "duration": per_bucket["duration"].map(units.duration),
    PARTS["overlapped"]: per_bucket["overlapped"].map(units.duration),
    PARTS["exposed"]: per_bucket["exposed"].map(units.duration)})
tables.table(table)
rows = state.guarded(loaders.load_rows, run) or []
exposed = [r for r in rows if r["metric"] == "overlap.exposed_dp_comm_per_step"]
if exposed:
    shown = pd.DataFrame(exposed)[["rank", "stage", "measured", "source", "explanation"]]
    shown["measured"] = shown["measured"].map(units.duration)
    tables.table(shown.rename(columns={"measured": "exposed DP communication per step"}), wide="explanation")
    for text in dict.fromkeys(shown["explanation"]):  # in full, each once
        st.caption(units.plain(text))
