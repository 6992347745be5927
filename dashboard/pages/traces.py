"""Traces: merge the run's per-rank profiler traces into one Perfetto trace and download it; where each profiled
step went, as a waterfall of its decomposition (ledger.present.step_waterfall); how to open the merged trace, and how
to capture the same steps with NVTX in Nsight Systems instead."""
from __future__ import annotations

import textwrap

import pandas as pd
import streamlit as st

from common.errors import UserError
from dashboard import state, tables
from ledger.present import dashboard_data, step_waterfall, units
from ledger.present.charts import STYLE, render
from ledger.present.report_view import NSYS_COMMAND
from ledger.present.step_table import CLASS_INTRO

state.start_page("Traces")
run = state.current_run()
if run is None:
    st.stop()
files = state.guarded(dashboard_data.trace_list, run)
if files is None:
    st.stop()
if not files:
    st.info("This run has no profiler traces. Record some with `--use-pytorch-profiler --profile-step-start A "
            "--profile-step-end B [--profile-ranks ...]`.")
else:
    listing = pd.DataFrame(files)
    listing["size"] = listing.pop("bytes").map(units.size)
    tables.table(listing)
    if st.button("Merge into one Perfetto trace", key="tr_merge"):
        st.session_state["tr_merged"] = run
    if st.session_state.get("tr_merged") == run:
        try:
            info, data = state.merged_trace(run)
        except UserError as exc:
            state.show_error(f"run {run}: {exc}")
        else:
            offsets = ", ".join(f"{r}: {o:+.1f}" for r, o in sorted(info["offsets_us"].items()))
            st.success(f"{units.count(info['events'])} events from ranks {info['ranks']}; clock offsets (µs) "
                       f"{offsets}")
            if info["uncorrected"]:
                st.warning(f"ranks {info['uncorrected']} share no collective with the others: their clocks are not "
                           "aligned")
            st.download_button("Download merged trace (.json.gz)", data, file_name=f"{run.replace('/', '_')}"
                               ".perfetto.json.gz", mime="application/gzip", key="tr_download")


def shell_lines(command: str, width: int = 96) -> str:
    """`command` wrapped at whole words into shell lines continued with a backslash, so its code block fits the page
    instead of scrolling sideways."""
    lines = textwrap.wrap(command, width - 2, break_long_words=False, break_on_hyphens=False)
    return " \\\n      ".join(lines)


if files:
    st.subheader("Where each profiled step went")
    steps = state.guarded(step_waterfall.step_decompositions, run)
    if steps == []:
        st.info("The reconciliation holds no step decomposition (its step.decomposition rows): `train-ledger "
                "reconcile` writes them from the traces.")
    elif steps:
        labels = [f"rank {d['rank']}, step {d['step']}" for d in steps]
        chosen = st.selectbox("rank and profiled step", range(len(steps)), format_func=labels.__getitem__,
                              key=f"tr_step:{run}")
        st.iframe(STYLE + render(step_waterfall.waterfall(steps[chosen])))
        if steps[chosen]["classes"]:
            st.caption(CLASS_INTRO)
            tables.table(pd.DataFrame([{"class": c["class"], "measured": units.duration(c["measured"]),
                                        "time model": units.duration(c["predicted"]),
                                        "gap": units.percent(c["gap"], signed=True), "verdict": c["verdict"]}
                                       for c in steps[chosen]["classes"]]))

st.subheader("Open it")
st.markdown(f"""
* **Perfetto**: open <https://ui.perfetto.dev>, *Open trace file*, pick the downloaded `.json.gz` (one process
  per rank, named with its tp/dp/pp coordinates; memory counters per rank). `chrome://tracing` opens it too.
* The same file from the shell: `train-ledger export-trace {state.resolve_run(run)} --out merged.json.gz
  [--steps A-B] [--ranks 0 1 4-7]`.
* **Nsight Systems with NVTX** (the probes' NVTX ranges never reach the PyTorch traces above): the profiler window
  calls cudaProfilerStart/Stop around steps A..B, so capture exactly those steps with
  ```
  {shell_lines(NSYS_COMMAND)}
  ```
  and open the `.nsys-rep` in the Nsight Systems GUI (NVTX rows: forward / backward per micro-batch, dp-comm
  buckets, optimizer).
""")
