"""Reconciliation: the ledger's rows (formula, inventory, measurement, verdict) with verdict colours, filters by
metric, rank and verdict, and each row's explanation. Every figure is written by ledger.present.units in its row's unit
(the exact numbers are in RUN/ledger/reconciliation.csv)."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import state, tables
from ledger.present import loaders, units
from ledger.present.row_groups import predictor

COLOURS = {"ok": "#c8e6c9", "warn": "#ffe0b2", "off": "#ffcdd2", "n/a": "#eceff1", "identity": "#e8eaf6"}
VALUES = ("predicted", "inventory", "measured")
# What fits a 1400 px window; a row's stage, tolerance, source and explanation are in the chosen row's box below.
COLUMNS = ["metric", "verdict", "rank", "bucket", "predicted", "predicted by", "inventory", "measured", "gap"]


def readable(table: pd.DataFrame) -> pd.DataFrame:
    """The rows as a person reads them: each figure in its row's unit, the gap in percent."""
    out = table.copy()
    for column in VALUES:
        out[column] = [units.value(v, u) for v, u in zip(table[column], table["unit"])]
    out["predicted by"] = [predictor(m) if pd.notna(p) else units.DASH
                           for m, p in zip(table["metric"], table["predicted"])]
    out["gap"] = table["rel_diff"].map(lambda x: units.percent(x, signed=True))
    for column in ("rank", "stage", "bucket"):  # Streamlit draws a missing number as "None": write "—" instead
        out[column] = table[column].map(lambda x: units.DASH if units.missing(x) else str(int(x)))
    return out.reindex(columns=COLUMNS)


run, summary, rows = state.open_page("Reconciliation", loaders.load_summary, loaders.load_rows)

counts = summary["verdicts"]
for column, verdict in zip(st.columns(len(counts)), counts):
    column.metric(verdict, counts[verdict])
for item in summary["missing"]:
    st.caption(f"missing: {units.plain(item)}")
if not rows:
    st.info("The run has no reconciliation rows yet.")
    st.stop()

table = pd.DataFrame(rows)
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


tables.table(readable(shown).style.map(colour, subset=["verdict"]))


def label(r: pd.Series) -> str:
    where = "".join(f" {key} {int(r[key])}" for key in ("rank", "bucket") if pd.notna(r[key]))
    return f"{r['metric']}{where}  [{r['verdict']}]"


if len(shown):
    labels = {i: label(r) for i, r in shown.iterrows()}
    chosen = st.selectbox("Explain a row", list(labels), format_func=labels.get, key="rec_row")
    r = shown.loc[chosen]
    where = ", ".join(f"{key} {int(r[key])}" for key in ("rank", "stage", "bucket") if pd.notna(r[key]))
    st.markdown(f"**{r['metric']}** ({where or 'the run'}; measured from {r['source'] or 'nothing'}): verdict "
                f"**{r['verdict']}** (tolerance {units.tolerance(r['tolerance'], r.get('abs_tolerance'), r['unit'])})")
    titles = {"predicted": f"predicted ({predictor(r['metric'])})", "inventory": "engine inventory",
              "measured": "measured"}
    for column, name in zip(st.columns(3), VALUES):
        column.metric(titles[name], units.value(r[name], r["unit"]))
    st.info(units.plain(r["explanation"]))
