"""The train-ledger dashboard: `train-ledger dashboard [--runs-root DIR]` runs this file under Streamlit.

This entry point is the frame around every page (st.navigation): page config, the sidebar's run selector shared
by all pages, then the chosen page. Each page is a small module in dashboard/pages/ that reads the ledger through
dashboard.state, so that a figure means the same here as in `train-ledger reconcile` and the report.
"""
from __future__ import annotations

import streamlit as st

from dashboard import state

# No page icons: Streamlit fetches Material icons from fonts.gstatic.com, and the dashboard must draw with no network.
PAGES = [
    st.Page("pages/runs.py", title="Runs", default=True),
    st.Page("pages/reconciliation.py", title="Reconciliation"),
    st.Page("pages/memory.py", title="Memory"),
    st.Page("pages/pipeline.py", title="Pipeline"),
    st.Page("pages/overlap.py", title="Overlap"),
    st.Page("pages/topology.py", title="Topology"),
    st.Page("pages/traces.py", title="Traces"),
    st.Page("pages/what_if.py", title="What if"),
]

st.set_page_config(page_title="train-ledger", layout="wide")
page = st.navigation(PAGES)
st.sidebar.caption(f"runs root: `{state.runs_root()}`")
state.select_run(state.list_runs())
page.run()
