"""Memory: one rank's bytes as a waterfall (static terms from the formulas, then activations, fragmentation and
memory outside PyTorch as measured) against allocated / reserved / NVML, and the per-step memory timeline."""
from __future__ import annotations

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
import streamlit as st

from common.units import human_bytes
from dashboard import state
from ledger import dashboard_data, loaders

# loaders.memory_waterfall's measured terms beyond the static ones, under the waterfall's names
MEASURED_TERMS = {"activations + transients": "activations", "reserved beyond peak": "fragmentation",
                  "outside PyTorch (CUDA context, NCCL, cuBLAS)": "non-PyTorch"}
LINES = {"peak": ("peak allocated", "#1565c0"), "reserved": ("reserved", "#6a1b9a"),
         "nvml_used": ("NVML used", "#c62828")}

run, static, waterfall, timeline = state.open_page("Memory", dashboard_data.static_breakdown,
                                                   loaders.memory_waterfall, loaders.memory_timeline)
if not static:
    st.info("No rank of this run wrote events yet.")
    st.stop()

ranks = [s["rank"] for s in static]
rank = st.selectbox("Rank", ranks, key="mem_rank")
terms = next(s for s in static if s["rank"] == rank)["terms"]
measured = next((w for w in waterfall if w["rank"] == rank), {"terms": []})
steps = [t for t in timeline if t["rank"] == rank]

bars: list[tuple[str, float, str]] = [(t["term"], t["predicted"], "formula") for t in terms if t["predicted"]]
for term in measured["terms"]:
    value = term["measured"] if term["measured"] is not None else term["predicted"]
    if term["term"] in MEASURED_TERMS and value:
        bars.append((MEASURED_TERMS[term["term"]], value, "measured" if term["measured"] is not None else "formula"))
if bars:
    fig = go.Figure(go.Waterfall(x=[b[0] for b in bars], y=[b[1] for b in bars], measure=["relative"] * len(bars),
                                 text=[f"{human_bytes(b[1])} ({b[2]})" for b in bars], textposition="outside"))
    for key, (label, colour) in LINES.items():
        values = [s[key] for s in steps if s.get(key) is not None]
        if values:
            fig.add_hline(y=max(values), line_dash="dash", line_color=colour,
                          annotation_text=f"{label} {human_bytes(max(values))}")
    fig.update_layout(title=f"rank {rank}: where the bytes are", yaxis_title="bytes", showlegend=False, height=480)
    st.plotly_chart(fig, width="stretch")
else:
    st.info("No static terms: the manifest has no config, and nothing was measured.")

table = pd.DataFrame(terms)
table["predicted"] = table["predicted"].map(lambda v: human_bytes(v) if v is not None else "—")
table["inventory"] = table["inventory"].map(lambda v: human_bytes(v) if v is not None else "—")
st.dataframe(table, hide_index=True)
if not any(s.get("peak") is not None for s in steps):
    st.caption("No CUDA memory_stats on this rank (a CPU run records process RSS only): the waterfall shows the "
               "formulas' terms, the timeline RSS.")

st.subheader("Per-step memory")
frame = pd.DataFrame(timeline)
if frame.empty:
    st.info("No per-step memory records.")
    st.stop()
shown = st.multiselect("Ranks", ranks, default=[rank], key="mem_ranks")
columns = [c for c in ("allocated", "peak", "reserved", "nvml_used", "rss") if frame[c].notna().any()]
long = frame[frame["rank"].isin(shown)].melt(id_vars=["rank", "step"], value_vars=columns, var_name="figure",
                                               value_name="bytes").dropna()
long["series"] = "rank " + long["rank"].astype(str) + " " + long["figure"]
st.plotly_chart(px.line(long, x="step", y="bytes", color="series", markers=True), width="stretch")
