"""Memory: one rank's bytes as a waterfall (static terms from the formulas, then activations, fragmentation and
memory outside PyTorch as measured) against allocated / reserved / NVML on CUDA, or the probes' tensor census on
CPU, and the per-step memory timeline (the process RSS on CPU). Captions say only what this rank measured."""
from __future__ import annotations

import pandas as pd
import plotly.express as px
import plotly.graph_objects as go
import streamlit as st

from dashboard import state, tables
from ledger.present import dashboard_data, loaders, units

# loaders.memory_waterfall's measured terms beyond the static ones, under the waterfall's names
MEASURED_TERMS = {loaders.CUDA_GRAPHS: "CUDA graphs", "activations + transients": "activations",
                  "reserved beyond peak": "fragmentation",
                  "outside PyTorch (CUDA context, NCCL, cuBLAS)": "non-PyTorch"}
LINES = {"peak": ("peak allocated", "#1565c0"), "reserved": ("reserved", "#6a1b9a"),
         "nvml_used": ("NVML used", "#c62828"), "census": ("static, CPU tensor census after step 1", "#2e7d32")}
FIGURES = {"allocated": "allocated", "peak": "peak allocated", "reserved": "reserved", "nvml_used": "NVML used",
           "rss": "process RSS"}  # loaders.memory_timeline's columns, as the chart names them

CAPTIONS = {  # what the waterfall's dashed lines are, by what measured this rank
    "cuda": "What to look for: each bar adds a term to the one before; the dashed lines are what the allocator and "
            "NVML measured at the peak. A gap between the last bar and NVML used is memory the terms miss.",
    "census": "What to look for: the static bars (params, grads, optimizer state) should end at the dashed line, "
              "the probes' census of the tensors the model and optimizer hold after step 1 (a CPU run has no "
              "allocator statistics and no NVML, so nothing measures the activations: that bar is the formula's).",
    "none": "What to look for: which term dominates the rank's memory; the run recorded no memory measurement for "
            "this rank, so there is no measured line to compare the terms with."}

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
peaks = {key: max(v) for key in ("peak", "reserved", "nvml_used")
         if (v := [s[key] for s in steps if s.get(key) is not None])}
on_cuda = any(s.get("peak") is not None for s in steps)
census = next((t["measured"] for t in measured["terms"] if t["term"] == "static" and t["measured"] is not None),
              None) if not on_cuda else None
if census is not None:  # a CPU run: the probes' census of the tensors the model and optimizer hold (no allocator)
    peaks["census"] = census
if bars:
    unit = units.axis_scale(max([sum(b[1] for b in bars), *peaks.values()]), "bytes")
    fig = go.Figure(go.Waterfall(x=[b[0] for b in bars], y=[b[1] / unit[0] for b in bars],
                                 measure=["relative"] * len(bars), textposition="outside",
                                 text=[f"{units.size(b[1])} ({b[2]})" for b in bars],
                                 hovertext=[f"{b[0]}: {units.exact(b[1], 'bytes')} ({b[2]})" for b in bars],
                                 hoverinfo="text"))
    for key, peak in peaks.items():
        label, colour = LINES[key]
        fig.add_hline(y=peak / unit[0], line_dash="dash", line_color=colour, annotation_text=f"{label} "
                      f"{units.size(peak)}")
    fig.update_layout(title=f"rank {rank}: where the bytes are", xaxis_title="term (formula, then measured)",
                      yaxis_title=f"bytes ({unit[1]})", showlegend=False, height=480)
    st.plotly_chart(fig, width="stretch")
    st.caption(CAPTIONS["cuda" if on_cuda else "census" if census is not None else "none"])
else:
    st.info("No static terms: the manifest has no config, and nothing was measured.")

COLUMNS = {"predicted": "formula", "inventory": "engine inventory", "expert_predicted": "of which experts (formula)",
           "expert_inventory": "of which experts (inventory)"}
table = pd.DataFrame(terms).rename(columns=COLUMNS)
for column in COLUMNS.values():
    if column in table:
        table[column] = table[column].map(units.size)
tables.table(table)
if "of which experts (formula)" in table:
    st.caption("Mixture of experts: the expert weights live in buffers of their own, reduced and sharded over the "
               "expert data-parallel group, so their share of each term is shown apart; the engine's optimizer "
               "state is one record for dense and expert elements, so only the buffers have an inventory split.")

st.subheader("Per-step memory")
frame = pd.DataFrame(timeline)
if frame.empty:
    st.info("No per-step memory records.")
    st.stop()
shown = st.multiselect("Ranks", ranks, default=[rank], key="mem_ranks")
columns = [c for c in FIGURES if frame[c].notna().any()]
long = frame[frame["rank"].isin(shown)].melt(id_vars=["rank", "step"], value_vars=columns, var_name="figure",
                                               value_name="bytes").dropna()
if long.empty:
    st.info("No per-step memory figure for the chosen ranks.")
    st.stop()
unit = units.axis_scale(long["bytes"].max(), "bytes")
long["series"] = "rank " + long["rank"].astype(str) + " " + long["figure"].map(FIGURES)
long["value"] = long["bytes"] / unit[0]
long["exact"] = long["bytes"].map(lambda b: units.exact(b, "bytes"))
fig = px.line(long, x="step", y="value", color="series", markers=True, hover_data={"exact": True, "value": False},
              labels={"step": "step", "value": f"bytes ({unit[1]})", "series": "rank and figure",
                      "exact": "bytes"})
fig.update_xaxes(dtick=1)  # steps are whole numbers
st.plotly_chart(fig, width="stretch")
st.caption("What to look for: a figure that keeps growing from step to step (a leak, or the allocator's cache "
           "filling), and ranks that differ (pipeline stages hold different activations)." if on_cuda else
           "On CPU this is the process's resident memory (RSS): the whole Python process, the profiler's buffers "
           "while it records (its steps grow it) and what the C allocator keeps after a free, so a rise over a few "
           "steps is no leak by itself; the model's own tensors are the census line of the waterfall above.")
