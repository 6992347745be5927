"""The simulator's machine side: a GPU kind from its hardware file, the groups' placement on nodes, and the time
model's Calibration built from them (torch-free).

    hw = load_hardware("H200")                  # or H100, A100-80GB, A100-40GB, or a path to a JSON file
    cal = hardware_calibration(cfg, hw)         # ledger.models.time_model.Calibration for cfg's kernels, rates and
    groups ledger.models.time_model.predict_step(cfg, cal)    # the step on hw, unchanged
    group_spans(cfg, hw.gpus_per_node)          # per group kind: nodes spanned, ranks per node, the bounding link

One concept a module: hardware (the file and its dataclass), kernel_cost (one kernel's seconds), topology (groups on
nodes, collective time), calibration (the Calibration).
"""
from ledger.models.simulate.calibration import hardware_calibration
from ledger.models.simulate.hardware import Hardware, load_hardware
from ledger.models.simulate.topology import (
           GroupSpan,
           TopologyLink,
           comm_model,
           group_spans,
)

__all__ = ["GroupSpan", "Hardware", "TopologyLink", "comm_model", "group_spans", "hardware_calibration",
           "load_hardware"]

# The layout search (layouts, bound, search): every valid layout on N GPUs, memory first, ranked by predicted tokens/s.
from ledger.models.simulate.bound import calibrated_bound  # noqa: E402
from ledger.models.simulate.layouts import enumerate_layouts  # noqa: E402
from ledger.models.simulate.search import Ranked, SearchResult, memory_fit, search  # noqa: E402

__all__ += ["Ranked", "SearchResult", "calibrated_bound", "enumerate_layouts", "memory_fit", "search"]
