"""What if: the selected run's layout changed on paper (GPUs, TP / PP / VPP, sequence parallel, batch, recompute,
distributed optimizer, GPU kind) and predicted by the simulator, beside the run as measured and as predicted for its
own layout; then the run as it ran, its profiled steps replayed with a change (dashboard.graph_what_if). The logic is
ledger.present.what_if's and ledger.present.graph_what_if's; this page only draws it."""
from __future__ import annotations

import pandas as pd
import streamlit as st

from common.config import MAX_LAYERS, MAX_WORLD_SIZE, RunConfig
from dashboard import graph_what_if, state
from ledger.models.simulate.hardware import known_names
from ledger.present import what_if
from ledger.present.charts import STYLE, Chart, empty, render

run, basis = state.open_page("What if", what_if.run_basis)
if basis["config"] is None:
    st.warning(f"This {basis['framework']} run has no configuration the ledger can read (for a Megatron-LM run, its "
               "arguments were not found): there is no model shape to simulate.")
    graph_what_if.section(run)
    st.stop()
cfg = RunConfig.from_dict(basis["config"])
own = what_if.own_choice(cfg)
names = known_names()


def key(name: str) -> str:
    """Widget keys per run: switching runs starts from that run's own layout."""
    return f"what_if:{run}:{name}"


st.caption(f"Run `{run}` on {basis['device'] or 'a device it did not record'}. Change the layout below: the "
           "what-if column and bars follow; the run's own prediction beside its measurement is the simulator's "
           "error on this run, the error bar to put on the what-if.")
run_hardware = basis["hardware"]
if run_hardware is None:
    st.warning(f"The run's device ({basis['device'] or 'not recorded'}) is no known hardware kind "
               f"({', '.join(names)}): pick the one to predict its own layout on.")
    run_hardware = st.columns(3)[0].selectbox("Hardware the run's own layout is predicted on", names,
                                              key=key("run_hardware"))

st.subheader("Layout and scale")
a, b, c, d, e = st.columns(5)
world = a.number_input("GPUs (world size)", 1, MAX_WORLD_SIZE, own.world_size, key=key("world"))
tp = b.number_input("tensor parallel", 1, MAX_WORLD_SIZE, own.tp, key=key("tp"))
pp = c.number_input("pipeline parallel", 1, MAX_WORLD_SIZE, own.pp, key=key("pp"))
vpp = d.number_input("virtual pipeline (chunks per stage)", 1, MAX_LAYERS, own.vpp, key=key("vpp"))
hardware = e.selectbox("hardware", names, index=names.index(run_hardware), key=key(f"hardware:{run_hardware}"))
a, b, c, d, e = st.columns(5)
micro = a.number_input("micro-batch size", 1, None, own.micro_batch_size, key=key("micro"))
global_batch = b.number_input("global batch size", 1, None, own.global_batch_size, key=key("global"))
recompute = c.selectbox("recompute granularity", what_if.RECOMPUTE, index=what_if.RECOMPUTE.index(own.recompute),
                        key=key("recompute"))
sp = d.checkbox("sequence parallel", own.sequence_parallel, key=key("sp"))
dist_opt = e.checkbox("distributed optimizer", own.distributed_optimizer, key=key("dist_opt"))
method, layers = own.recompute_method, own.recompute_num_layers
a, b, c, _, _ = st.columns(5)
if recompute == "full":
    method = a.selectbox("recompute method", what_if.RECOMPUTE_METHODS,
                         index=what_if.RECOMPUTE_METHODS.index(own.recompute_method), key=key("method"))
    layers = b.number_input("recompute layers", 1, MAX_LAYERS, own.recompute_num_layers, key=key("layers"))
ends = c.checkbox("ends as layers", own.ends_as_layers, key=key("ends"),
                  help="The pipeline split counts the embedding and the loss as a layer each (Megatron-LM's "
                       "--account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split): the "
                       "first stage's first chunk holds one layer fewer, the last stage's last chunk too (Llama 3 "
                       "405B's split)")

choice = what_if.Choice(world_size=int(world), tp=int(tp), pp=int(pp), vpp=int(vpp), sequence_parallel=sp,
                        micro_batch_size=int(micro), global_batch_size=int(global_batch), recompute=recompute,
                        recompute_method=method, recompute_num_layers=int(layers), distributed_optimizer=dist_opt,
                        ends_as_layers=ends)
ran = what_if.predict(cfg, run_hardware)
changed = what_if.predict_choice(cfg, choice, hardware)
if ran.error:
    st.warning(f"The run's own layout cannot be predicted on {run_hardware}: {ran.error}")
if changed.error:
    st.warning(f"The what-if layout cannot be predicted: {changed.error}")
elif not changed.prediction["memory"]["fits"]:
    st.warning(f"The what-if layout does not fit in the {hardware}'s HBM: see the memory bars below.")


def draw(title: str, chart: Chart) -> None:
    """ledger.present.charts' SVG in an iframe sized to it (st.html would strip the SVG); our own markup, every label
    escaped by render."""
    st.subheader(title)
    st.iframe(STYLE + (render(chart) if chart.bars else empty(title, "nothing measured and no prediction")))


draw("Step time, term by term", what_if.step_chart(basis, ran.prediction, changed.prediction))
draw("Memory per GPU against HBM", what_if.memory_chart(basis, ran.prediction, changed.prediction))
st.subheader("Measured, predicted for the run's layout, predicted for the what-if")
state.timing_caveat(run)
rows = what_if.comparison(basis, ran.prediction, changed.prediction)
st.table(pd.DataFrame(what_if.formatted(rows)).set_index("figure"))
st.caption("Measured figures are the run's reconciliation rows (largest rank for memory and times, mean for "
           "throughput); TFLOP/s and MFU under both conventions (megatron: Megatron's FLOP count; palm_6n: 6N per "
           "token plus attention). A dash: nothing measured it, or no prediction.")

graph_what_if.section(run)
