"""The train-ledger dashboard: `train-ledger dashboard [--runs-root DIR]` runs this file under Streamlit.

This entry point is the frame around every page (st.navigation): page config, the sidebar's run selector shared
by all pages, then the chosen page. Each page is a small module in dashboard/pages/ that reads the ledger through
dashboard.state, so that a figure means the same here as in `train-ledger reconcile` and the report.
"""
from __future__ import annotations

import streamlit as st

from dashboard import state

PAGES = [
    st.Page("pages/runs.py", title="Runs", icon=":material/list:", default=True),
    st.Page("pages/reconciliation.py", title="Reconciliation", icon=":material/rule:"),
    st.Page("pages/memory.py", title="Memory", icon=":material/memory:"),
    st.Page("pages/pipeline.py", title="Pipeline", icon=":material/view_timeline:"),
    st.Page("pages/overlap.py", title="Overlap", icon=":material/stacked_bar_chart:"),
    st.Page("pages/topology.py", title="Topology", icon=":material/hub:"),
    st.Page("pages/traces.py", title="Traces", icon=":material/timeline:"),
    st.Page("pages/what_if.py", title="What if", icon=":material/tune:"),
]

st.set_page_config(page_title="train-ledger", layout="wide")
page = st.navigation(PAGES)
st.sidebar.caption(f"runs root: `{state.runs_root()}`")
state.select_run(state.list_runs())
page.run()
