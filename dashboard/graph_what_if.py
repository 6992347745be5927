"""The "What if" page's section on the run as it ran: its profiled steps replayed from its own execution graph with
kernels (all, or the GEMMs or attention alone) or communication faster, the launch gaps gone or the straggler brought
to the median
(ledger.present.graph_what_if; docs/formulas.md, "What if on the graph"). The simulator's sections above change the
layout on paper; this one changes the measured run."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from dashboard import state
from ledger.models.graph_what_if import Change
from ledger.present import graph_what_if


def section(run: str) -> None:
    st.subheader("On the run as it ran: its steps replayed with a change")
    st.caption("The profiled steps' execution graph (every traced rank's Kineto trace) re-run from its measured "
               "durations, then with the change below: the measured step, the replay and the what-if per rank and "
               "step. `train-ledger whatif RUN` gives the same in the shell.")
    a, b, c = st.columns(3)
    kernels = a.number_input("kernels x faster", min_value=0.1, max_value=100.0, value=1.0, step=0.5,
                             key=f"graph_what_if:{run}:kernels")
    matmul = b.number_input("GEMMs x faster", min_value=0.1, max_value=100.0, value=1.0, step=0.5,
                            help="on top of all kernels: those launched by GEMM ops", key=f"graph_what_if:{run}:matmul")
    attention = c.number_input("attention x faster", min_value=0.1, max_value=100.0, value=1.0, step=0.5,
                               help="on top of all kernels: those launched by attention ops",
                               key=f"graph_what_if:{run}:attention")
    d, e, f = st.columns(3)
    comm = d.number_input("communication x faster", min_value=0.1, max_value=100.0, value=1.0, step=0.5,
                          key=f"graph_what_if:{run}:comm")
    gaps = e.checkbox("no launch gaps", help="the host's launch gaps gone, as CUDA graphs would have it",
                      key=f"graph_what_if:{run}:gaps")
    straggler = f.checkbox("no straggler", help="the slowest rank's compute brought to the median rank's",
                           key=f"graph_what_if:{run}:straggler")
    change = Change(float(kernels), float(comm), gaps, straggler, float(matmul), float(attention))
    if change == Change():
        st.info("Pick a change above to replay the run's profiled steps with it.")
        return
    answer = state.guarded(graph_what_if.replay_what_if, run, change)
    if answer is None:
        return
    st.markdown("\n".join(f"- {text}" for text in answer["changed"]))
    st.table(pd.DataFrame(answer["table"]).set_index(["rank", "step"]))
    st.caption("The job (each step's slowest rank), replayed -> what if: " + "; ".join(answer["job"]) + ". "
               + " ".join(answer["notes"]))
