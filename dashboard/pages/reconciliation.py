"""Reconciliation: the ledger's rows (formula, inventory, measurement, verdict) with verdict colours, filters by
metric, rank and verdict, and each row's explanation."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from common.units import human
from dashboard import state
from ledger import loaders

COLOURS = {"ok": "#c8e6c9", "warn": "#ffe0b2", "off": "#ffcdd2", "n/a": "#eceff1", "identity": "#e8eaf6"}
COLUMNS = ["metric", "verdict", "rank", "stage", "bucket", "predicted", "inventory", "measured", "unit", "rel_diff",
           "tolerance", "scope", "source", "explanation"]
FORMATS = {**{c: "{:.0f}" for c in ("rank", "stage", "bucket")},
           **{c: "{:,.6g}" for c in ("predicted", "inventory", "measured", "tolerance")}, "rel_diff": "{:+.2%}"}

run, summary, rows = state.open_page("Reconciliation", loaders.load_summary, loaders.load_rows)

counts = summary["verdicts"]
for column, verdict in zip(st.columns(len(counts)), counts):
    column.metric(verdict, counts[verdict])
for item in summary["missing"]:
    st.caption(f"missing: {item}")
if not rows:
    st.info("The run has no reconciliation rows yet.")
    st.stop()

table = pd.DataFrame(rows).reindex(columns=COLUMNS)
families = sorted({m.split(".")[0] for m in table["metric"]})
left, middle, right = st.columns(3)
family = left.multiselect("Metric family", families, key="rec_family")
metrics = sorted(m for m in table["metric"].unique() if not family or m.split(".")[0] in family)
metric = left.multiselect("Metric", metrics, key="rec_metric")
ranks = sorted(int(r) for r in table["rank"].dropna().unique())
rank = middle.multiselect("Rank", ranks, key="rec_rank")
verdict = right.multiselect("Verdict", list(COLOURS), key="rec_verdict")

shown = table
if family:
    shown = shown[shown["metric"].str.split(".").str[0].isin(family)]
if metric:
    shown = shown[shown["metric"].isin(metric)]
if rank:
    shown = shown[shown["rank"].isin(rank)]
if verdict:
    shown = shown[shown["verdict"].isin(verdict)]
st.caption(f"{len(shown)} of {len(table)} rows")


def colour(value: str) -> str:
    return f"background-color: {COLOURS.get(value, '')}"


st.dataframe(shown.style.map(colour, subset=["verdict"]).format(FORMATS, na_rep=""), hide_index=True,
             width="stretch")



def label(r: pd.Series) -> str:
    where = "".join(f" {key} {int(r[key])}" for key in ("rank", "bucket") if pd.notna(r[key]))
    return f"{r['metric']}{where}  [{r['verdict']}]"


def cell(value: float, unit: str) -> str:
    return human(None if pd.isna(value) else value, unit)


if len(shown):
    labels = {i: label(r) for i, r in shown.iterrows()}
    chosen = st.selectbox("Explain a row", list(labels), format_func=labels.get, key="rec_row")
    r = shown.loc[chosen]
    st.markdown(f"**{r['metric']}**: verdict **{r['verdict']}** (tolerance {r['tolerance']:g})")
    for column, name in zip(st.columns(3), ("predicted", "inventory", "measured")):
        column.metric({"predicted": "formula"}.get(name, name), cell(r[name], r["unit"]))
    st.info(r["explanation"])
