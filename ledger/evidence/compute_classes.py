"""A profiled step's device compute cut by compute class (common/ops/compute_class.py): matmul, attention, the
optimizer and other kernels. The classes add up to the step decomposition's device-compute term.

A GPU kernel takes the class of the host op that launched it: inside the optimizer's range (the engine's
"optimizer" annotation, torch's "Optimizer.step#...") it is the optimizer's; else inside an attention op (the
aten::_scaled_dot_product_* family, flash, cuDNN and memory-efficient attention and their backwards) attention;
else inside a GEMM op (aten::mm, addmm, bmm, baddbmm, _scaled_mm, _grouped_mm) matmul; else other. A kernel replayed
from a CUDA graph (or whose launch the trace lost) has no launching op of its own, so its name decides, by the
libraries' kernel names. On a CPU trace the ops themselves are the compute: each instant of device compute goes to
the class of an op running then. Where kernels of two classes overlap (two streams), an instant goes to the first
class in the order above, so the classes partition the term.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from common.intervals import Interval, length, subtract, union
from common.ops.compute_class import ATTENTION, MATMUL, OPTIMIZER, OTHER
from ledger.evidence.exec_graph import ANNOTATION, CPU_OP, ExecGraph, GpuOp, HostOp
from ledger.evidence.step_partition import device_compute

ORDER = (OPTIMIZER, ATTENTION, MATMUL)  # the classes that claim an instant first; the rest is OTHER
ENGINE_OPTIMIZER, TORCH_OPTIMIZER_STEP = "optimizer", "Optimizer.step#"  # the engine's range; torch's, per optimizer
ATTENTION_OPS = ("aten::_scaled_dot_product_", "aten::_flash_attention_", "aten::_efficient_attention_",
                 "aten::_cudnn_attention_", "aten::scaled_dot_product_attention")
MATMUL_OPS = frozenset({"aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm", "aten::baddbmm_",
                        "aten::_scaled_mm", "aten::_grouped_mm", "aten::_scaled_grouped_mm"})
ATTENTION_KERNELS = ("flash", "fmha", "sdpa", "cudnn")  # lower case
MATMUL_KERNELS = ("gemm", "nvjet", "cutlass", "xmma", "cublas")


def op_class(op: HostOp) -> str | None:
    """The class a host op gives what runs inside it, None when it gives none."""
    if op.kind == ANNOTATION and (op.name == ENGINE_OPTIMIZER or op.name.startswith(TORCH_OPTIMIZER_STEP)):
        return OPTIMIZER
    if op.kind != CPU_OP:
        return None
    if op.name.startswith(ATTENTION_OPS):
        return ATTENTION
    return MATMUL if op.name in MATMUL_OPS else None


def kernel_name_class(name: str) -> str:
    """A kernel's class from its name alone (a graph replay's kernels)."""
    lower = name.lower()
    if any(k in lower for k in ATTENTION_KERNELS):
        return ATTENTION
    return MATMUL if any(k in lower for k in MATMUL_KERNELS) else OTHER


@dataclass
class _Spans:
    """One thread's ops of one class, merged: when a launch on that thread lies inside one."""
    spans: list[Interval]

    def __post_init__(self) -> None:
        self.starts = [s for s, _ in self.spans]

    def holds(self, t: float) -> bool:
        i = bisect_right(self.starts, t) - 1
        return i >= 0 and self.spans[i][1] >= t


def _thread_spans(graph: ExecGraph) -> dict[object, dict[str, _Spans]]:
    out: dict[object, dict[str, _Spans]] = {}
    for t in graph.threads:
        by_class: dict[str, list[Interval]] = {cls: [] for cls in ORDER}
        for op in t.ops:
            cls = op_class(op)
            if cls is not None:
                by_class[cls].append((op.start, op.end))
        out[t.thread] = {cls: _Spans(union(spans)) for cls, spans in by_class.items()}
    return out


def _gpu_class(op: GpuOp, spans: dict[object, dict[str, _Spans]]) -> str:
    launch = op.launch
    if launch is None or "Graph" in launch.name:
        return kernel_name_class(op.name)
    thread = spans.get(launch.thread, {})
    return next((cls for cls in ORDER if cls in thread and thread[cls].holds(launch.start)), OTHER)


def gpu_op_classes(graph: ExecGraph) -> dict[int, str]:
    """The class of each GPU op that is no NCCL kernel, by id(op)."""
    spans = _thread_spans(graph)
    return {id(op): _gpu_class(op, spans) for op in graph.gpu_ops() if op.collective is None}


def host_op_classes(graph: ExecGraph) -> dict[int, str]:
    """The class of each host op, by id(op): the first of ORDER that it or an op enclosing it gives, else OTHER (a
    CPU trace's compute ops by what they run inside)."""
    out: dict[int, str] = {}
    for t in graph.threads:
        stack: list[tuple[HostOp, str | None]] = []
        for op in t.ops:  # by start, enclosing first
            while stack and stack[-1][0].end <= op.start:
                stack.pop()
            stack.append((op, op_class(op)))
            found = {cls for _, cls in stack}
            out[id(op)] = next((cls for cls in ORDER if cls in found), OTHER)
    return out


def class_spans(graph: ExecGraph) -> dict[str, list[Interval]]:
    """Per class of ORDER, when work of that class ran: a GPU trace's kernels (not NCCL's) by their launch, a CPU
    trace's ops of the class."""
    if graph.on_gpu:
        classes = gpu_op_classes(graph)
        by_class: dict[str, list[Interval]] = {cls: [] for cls in ORDER}
        for op in graph.gpu_ops():
            cls = classes.get(id(op), OTHER)
            if cls != OTHER:
                by_class[cls].append((op.start, op.end))
        return {cls: union(s) for cls, s in by_class.items()}
    ops = [op for t in graph.threads if not t.comm_worker for op in t.ops]
    return {cls: union((op.start, op.end) for op in ops if op_class(op) == cls) for cls in ORDER}


def compute_by_class(graph: ExecGraph, step: int, spans: dict[str, list[Interval]] | None = None,
                     compute: list[Interval] | None = None) -> list[tuple[str, float]]:
    """(class, µs) of `step`'s device compute, in ORDER then OTHER; they add up to the step's device compute.
    `spans` and `compute`: class_spans(graph) and step_partition.device_compute(graph), computed once per graph."""
    window = graph.steps[step]
    spans = class_spans(graph) if spans is None else spans
    rest = subtract(device_compute(graph) if compute is None else compute,
                    [(float("-inf"), window.start), (window.end, float("inf"))])
    out = []
    for cls in ORDER:
        left = subtract(rest, spans[cls])
        out.append((cls, length(rest) - length(left)))
        rest = left
    return out + [(OTHER, length(rest))]
