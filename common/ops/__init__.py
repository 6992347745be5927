"""The catalogue of the operations one rank computes in a training step: one source for the time model and the
compute sweep. Torch-free.

    sh = Shapes.of(cfg)                              # the rank's TP-local, CP-local sizes of one micro-batch
    ops = rank_ops(sh, first_stage, last_stage)      # RankOps: layer (LayerOps), embedding, head, optimizer, ...
    ops.kernels()                                    # every distinct Kernel (name, dims, FLOPs), each once
    bytes_moved(kernel, dtype_bytes, grad_bytes)     # its memory traffic (traffic.py)

Each entry is a Kernel named after the engine's module and pass (Megatron Core's names) with the dims that set its
cost; the groups (LayerOps, SelfAttentionOps, MLPOps, MoEOps, Linear, Passes) are records of them. The time model
(ledger/models/time_model/ops.py) reads the groups' fields to lay out each pass in execution order and prices the
entries from a calibration; the compute sweep (probes/compute_sweep/) times every entry of `kernels()` and every
per-element `rates` entry through the engine's own functions. Neither keeps a list of its own, so what one prices
the other has measured. docs/formulas.md ("Time model", "FLOPs") derives the counts.

One module a part: sizes (the config's arithmetic), shapes, kernel (Kernel, OpGroup, Passes), linear (GEMMs),
attention (dense and ring), mlp, moe, layer, rank (a pipeline rank's whole set and the per-element rates), traffic
(bytes moved), host (the kinds of call the host makes to run them: what the host sweep times).
"""
from common.ops.kernel import Kernel, OpGroup, Passes, kernel
from common.ops.layer import SUSTAINED, LayerOps, layer_ops
from common.ops.linear import GEMM_PASSES, Linear
from common.ops.rank import PER_ELEMENT, RATE_OPS, RankOps, Rate, rank_ops
from common.ops.shapes import ExpertShapes, Shapes
from common.ops.traffic import bytes_moved, bytes_per_element

__all__ = ["GEMM_PASSES", "PER_ELEMENT", "RATE_OPS", "SUSTAINED", "ExpertShapes", "Kernel", "LayerOps", "Linear",
           "OpGroup", "Passes", "RankOps", "Rate", "Shapes", "bytes_moved", "bytes_per_element", "kernel", "layer_ops",
           "rank_ops"]
