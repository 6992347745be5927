"""Topology: the run's ranks placed on the grid of docs/engine.md, "Rank groups" (one row per pipeline stage; within a
row, the DP replicas side by side, each a block of its TP ranks) with the TP, DP and PP groups drawn as connections."""
from __future__ import annotations

import pandas as pd
import plotly.graph_objects as go
import streamlit as st

from dashboard import state, tables
from ledger.present import loaders

GROUP_STYLE = {"tp": ("TP group (layer shards)", "#1e88e5", 0.0), "dp": ("DP group (replicas)", "#43a047", 0.16),
               "pp": ("PP group (stages)", "#e53935", 0.0)}
BLOCK_GAP = 0.6

run, topo = state.open_page("Topology", loaders.topology)
st.caption(f"world {topo['world_size']} = TP{topo['tp']} x DP{topo['dp']} x PP{topo['pp']}")


def position(coords: dict[str, int]) -> tuple[float, float]:
    """x: the rank's TP slot inside its (dp, cp) replica block, blocks spaced apart; y: its stage (stage 0 on top)."""
    block = coords.get("dp", 0) * max(1, topo["world_size"] // (topo["tp"] * topo["dp"] * topo["pp"])) \
        + coords.get("cp", 0)
    return block * (topo["tp"] + BLOCK_GAP) + coords.get("tp", 0), -float(coords.get("pp", 0))


coords_of = {r["rank"]: r["coords"] for r in topo["ranks"]}
where = {rank: position(c) for rank, c in coords_of.items()}
fig = go.Figure()
for kind, (label, colour, dip) in GROUP_STYLE.items():
    xs: list[float | None] = []
    ys: list[float | None] = []
    for group in topo["groups"][kind]:
        if len(group) < 2:
            continue
        # groups of one kind that share a row are drawn a little apart, by the TP slot of their first rank
        offset = dip * (1 + 0.5 * coords_of[group[0]].get("tp", 0)) if dip else 0.0
        for x, y in sorted(where[r] for r in group):
            xs.append(x)
            ys.append(y - offset)
        xs.append(None)
        ys.append(None)
    if xs:
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines", name=label, line=dict(color=colour, width=4)))
fig.add_trace(go.Scatter(
    x=[where[r["rank"]][0] for r in topo["ranks"]], y=[where[r["rank"]][1] for r in topo["ranks"]],
    mode="markers+text", name="rank", marker=dict(size=46, color="#fafafa", line=dict(color="#424242", width=2)),
    text=[f"<b>{r['rank']}</b>" for r in topo["ranks"]], textfont=dict(size=16),
    hovertext=[r["label"] for r in topo["ranks"]], hoverinfo="text"))
for stage in range(topo["pp"]):
    fig.add_annotation(x=-0.9, y=-stage, text=f"stage {stage}", showarrow=False, xanchor="right")
fig.update_xaxes(visible=False, range=[-2.2, max(x for x, _ in where.values()) + 0.8])
fig.update_yaxes(visible=False, range=[-topo["pp"] + 0.4, 0.6])
fig.update_layout(height=180 + 140 * topo["pp"], legend=dict(orientation="h"), plot_bgcolor="white")
st.plotly_chart(fig, width="stretch")

st.subheader("Groups")
tables.table(pd.DataFrame([{"kind": kind.upper(), "groups": str(groups)} for kind, groups in topo["groups"].items()]),
             wide="groups")
tables.table(pd.DataFrame([{"rank": r["rank"], **r["coords"], "label": r["label"]} for r in topo["ranks"]]))
