"""Overlap: each DP bucket's collective drawn over the rank's compute in one step, and the time each bucket left
exposed (no compute beside it), as the ledger's overlap rows compute it from the timers."""
from __future__ import annotations

import pandas as pd
import plotly.express as px
import streamlit as st

from dashboard import state
from ledger import dashboard_data, loaders

run, intervals = state.open_page("Overlap", loaders.bucket_intervals)
if not intervals:
    st.info("No DP bucket timers in this run (run with --timers; buckets exist with DP > 1).")
    st.stop()

frame = pd.DataFrame(intervals)
left, right = st.columns(2)
rank = left.selectbox("Rank", sorted(frame["rank"].unique()), key="ov_rank")
steps = sorted(frame.loc[frame["rank"] == rank, "step"].unique())
step = right.selectbox("Step", steps, index=len(steps) - 1, key="ov_step")

timing = state.guarded(dashboard_data.rank_timing, run, int(rank), int(step))
if timing:
    bars = pd.DataFrame(timing)
    base = bars["start"].min()
    bars["lane"] = bars.apply(lambda t: t["name"] if pd.notna(t["bucket"]) else t["category"], axis=1)
    bars["ms"] = (bars["end"] - bars["start"]) * 1e3
    fig = px.bar(bars, base=(bars["start"] - base) * 1e3, x="ms", y="lane", color="category", orientation="h",
                 hover_name="name")
    fig.update_layout(title=f"rank {rank}, step {step}", xaxis_title="ms from the step's first timer",
                      yaxis_title="", height=120 + 28 * bars["lane"].nunique())
    st.plotly_chart(fig, width="stretch")

st.subheader("Exposed time per bucket")
mine = frame[frame["rank"] == rank].assign(duration=lambda f: f["end"] - f["start"])
per_bucket = mine.groupby(["op", "bucket"], as_index=False).agg(
    duration_ms=("duration", "mean"), overlapped_ms=("overlapped", "mean"), exposed_ms=("exposed", "mean"),
    steps=("step", "nunique"))
per_bucket[["duration_ms", "overlapped_ms", "exposed_ms"]] *= 1e3
per_bucket["bucket"] = per_bucket["op"] + " bucket " + per_bucket["bucket"].astype(str)
st.plotly_chart(px.bar(per_bucket, x="bucket", y=["overlapped_ms", "exposed_ms"], title="mean over steps (ms)"),
                width="stretch")
st.dataframe(per_bucket, hide_index=True)
rows = state.guarded(loaders.load_rows, run) or []
exposed = [r for r in rows if r["metric"] == "overlap.exposed_dp_comm_per_step"]
if exposed:
    st.dataframe(pd.DataFrame(exposed)[["rank", "stage", "measured", "source", "explanation"]]
                 .rename(columns={"measured": "exposed s / step"}), hide_index=True)
