"""A hardware file's `host` block: the host primitives' seconds per call (common/ops/host.py) on the machine the
GPU's runs ran on, plain and under torch.profiler, and the launch latency.

    python3 runs/bench/host_block.py --sweep RUN_OR_JSONL [--gpu H200] [--write] [--out F]  # a host sweep's records
    python3 runs/bench/host_block.py --traces RUN [RUN ...] [--graphs JSONL] [--gpu H200] [--write]  # from traces

--sweep reads the records of `runs/bench/host_sweep_h200.sh` (a run directory, or its host_sweep.jsonl): the block
is the sweep's medians, measured. --traces is the stand-in until a sweep exists: each primitive's in-context
duration in the runs' profiled steps (ledger.evidence.exec_graph: e.g. `eager` is a top-level aten::add with its one
launch, `compiled` a Torch-Compiled Region launching one kernel, `autograd_node` a view's backward node), which is
the profiled figure; the plain figure is that times the run's own ratio of unprofiled to profiled forward ranges
(its timers: host-bound ranges, so the ratio is the host's). `module` stands for the Python between
the calls: the forward ranges' untraced time over the forward recipe's module count. Calibration runs only: a run
whose trace priced the block is never one the block is judged on (BENCHMARKS.md names the split).
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.events import parse_event  # noqa: E402
from common.ops import host as p  # noqa: E402
from ledger.evidence.exec_graph import ANNOTATION, RUNTIME, ExecGraph, HostOp, read_graph  # noqa: E402
from ledger.evidence.read import read_run  # noqa: E402
from ledger.models.simulate.hardware import hardware_file, write_hardware_json  # noqa: E402
from ledger.models.time_model import host_recipe  # noqa: E402
from ledger.models.time_model.host_costs import LAUNCH_LATENCY  # noqa: E402
from ledger.models.time_model.ops import chunk_ends, chunk_forward  # noqa: E402

LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cuLaunchKernelEx")
VIEWS = ("aten::permute", "aten::view", "aten::t", "aten::reshape")
NO_KERNEL_NODES = ("PermuteBackward0", "ViewBackward0", "TBackward0", "AddBackward0", "UnsafeViewBackward0")
NODE = "autograd::engine::evaluate_function: "
LATENCY_SOURCE = ("the calibration run h200_2layer_profiled's mean time from a launch call's return to its "
                  "kernel's start, over the kernels launched after the device had gone idle (1.30-1.58 us in its "
                  "three profiled steps)")  # a --sweep block's: a sweep launches onto a busy device


class _Trace:
    """A trace's host ops with what each encloses, for the primitives' samples."""

    def __init__(self, graph: ExecGraph):
        self.graph = graph
        self.launched = {id(op.launch) for op in graph.gpu_ops() if op.launch is not None}
        self.windows = list(graph.steps.values())

    def ops(self):
        for t in self.graph.threads:
            for i, op in enumerate(t.ops):
                if any(w.start <= op.start < w.end for w in self.windows):
                    yield t, i, op

    def inner(self, t, i: int, op: HostOp) -> list[HostOp]:
        found = []
        for x in t.ops[i + 1:]:
            if x.start >= op.end:
                break
            found.append(x)
        return found

    def launches(self, t, i: int, op: HostOp) -> int:
        return sum(id(x) in self.launched for x in [op, *self.inner(t, i, op)])


def primitive(tr: _Trace, t, i: int, op: HostOp) -> tuple[str, float] | None:
    """The primitive a traced op is a sample of, and its seconds (a Function's without the linear inside it)."""
    d, name = (op.end - op.start) / 1e6, op.name
    if op.kind == RUNTIME:
        if name in LAUNCHES:
            return p.LAUNCH, d
        if name == "cudaEventRecordWithFlags":
            return p.EVENT_RECORD, d
        if name in ("cudaStreamSynchronize", "cudaEventSynchronize") and d < 50e-6:  # nothing left to wait for
            return p.SYNC, d
        return None
    if name.startswith(NODE):
        node = name[len(NODE):]
        if node in NO_KERNEL_NODES:
            return p.AUTOGRAD_NODE, d
        if node == "CompiledFunctionBackward":
            return p.COMPILED_BACKWARD, d
        return (p.ATTENTION_BACKWARD, d) if "Attention" in node else None
    if name == "_LinearWithGradAccumulation":
        return p.FUNCTION, d - sum(x.end - x.start for x in tr.inner(t, i, op) if x.name == "aten::linear") / 1e6
    direct = {"aten::matmul": p.GEMM, "aten::scaled_dot_product_attention": p.ATTENTION}
    if name in direct:
        return direct[name], d
    if name == "aten::add" and tr.launches(t, i, op) == 1:
        return p.EAGER, d
    if name in VIEWS and tr.launches(t, i, op) == 0:
        return p.VIEW, d
    if name.startswith("Torch-Compiled Region") and tr.launches(t, i, op) == 1:
        return p.COMPILED, d
    return (p.ITEM, d) if name == "aten::item" and d < 200e-6 else None  # a read of a drained device


def trace_samples(graph: ExecGraph) -> dict[str, list[float]]:
    """Profiled in-context seconds of each primitive the trace shows directly."""
    tr, found = _Trace(graph), defaultdict(list)
    for t, i, op in tr.ops():
        sample = primitive(tr, t, i, op)
        if sample is not None:
            found[sample[0]].append(sample[1])
    return found


def forward_ranges(graph: ExecGraph) -> list[tuple[float, float, float]]:
    """(span, untraced time inside) of each forward range, in seconds."""
    out = []
    for t in graph.threads:
        for op in t.ops:
            if op.kind == ANNOTATION and op.name.startswith("forward stage"):
                top = [x for x in t.ops if op.start <= x.start < op.end and x.depth == op.depth + 1]
                out.append(((op.end - op.start) / 1e6, (op.end - op.start - sum(x.end - x.start for x in top)) / 1e6))
    return out


def backward_lead(graph: ExecGraph) -> list[float]:
    """From each backward range's start to the first autograd node's start (torch.autograd.backward's own cost)."""
    nodes = sorted(op.start for t in graph.threads for op in t.ops if op.name.startswith(NODE))
    out = []
    for t in graph.threads:
        for op in t.ops:
            if op.kind == ANNOTATION and op.name.startswith("backward stage"):
                first = next((s for s in nodes if op.start <= s < op.end), None)
                if first is not None:
                    out.append((first - op.start) / 1e6)
    return out


def forward_modules(run: Path) -> float:
    """The module count of one micro-batch's forward range in the host recipe (the run's config)."""
    cfg = read_run(run).config
    first, last = chunk_ends(cfg, 0, 0)
    recipes = [host_recipe.entry(w, True) for w in chunk_forward(cfg, 0, 0)]
    recipes += [host_recipe.forward_start(first), host_recipe.forward_end(last)]
    return sum(r.get(p.MODULE, 0) for r in recipes)


def unprofiled_ratio(run: Path) -> float:
    """The run's unprofiled over profiled forward ranges, medians of its timer ranges after step 1: a host-bound
    range (the main thread's), so the host's own ratio, taken for every primitive (a backward range that the device
    bounds, unprofiled, says nothing of the host)."""
    ev = read_run(run)
    profiled = {s.step for r in ev.ranks.values() for s in r.steps if s.profiled}
    timing = [t for r in ev.ranks.values() for t in r.timing
              if t.step and t.step > 1 and t.duration_s and t.category == "forward"]
    return (median(t.duration_s for t in timing if t.step not in profiled)
            / median(t.duration_s for t in timing if t.step in profiled))


def launch_latencies(graph: ExecGraph) -> list[float]:
    """Seconds from a launch call's return to its kernel's start, for each kernel of the profiled steps launched after
    the device had gone idle (one launched onto a busy stream waits for its predecessor instead)."""
    out = []
    for window in graph.steps.values():
        ops = sorted((op for op in graph.gpu_ops() if op.collective is None and window.start <= op.start < window.end),
                     key=lambda op: op.start)
        end = ops[0].end
        for op in ops[1:]:
            if op.launch is not None and op.launch.end > end:
                out.append((op.start - op.launch.end) / 1e6)
            end = max(end, op.end)
    return out


def from_traces(runs: list[Path], gpu: str, cpu: str) -> dict:
    profiled: dict[str, list[float]] = defaultdict(list)
    plain: dict[str, list[float]] = defaultdict(list)
    latencies: list[float] = []
    for run in runs:
        graph = read_graph(next((run / "traces").glob("*.json.gz")))
        latencies += launch_latencies(graph)
        ratio = unprofiled_ratio(run)
        found = {k: median(v) for k, v in trace_samples(graph).items()}
        found[p.MODULE] = median(gap for _, gap in forward_ranges(graph)) / forward_modules(run)
        found[p.BACKWARD_CALL] = median(backward_lead(graph))
        found[p.EAGER_BACKWARD] = found[p.AUTOGRAD_NODE] + found[p.EAGER]  # a node and its one eager op
        for k, v in found.items():
            profiled[k].append(v)
            plain[k].append(v * ratio)
        print(f"{run.name}: unprofiled / profiled forward ranges {ratio:.3f}; " + ", ".join(
            f"{k} {found[k] * 1e6:.1f}" for k in p.HOST_PRIMITIVES) + " us (profiled)")
    names = ", ".join(r.name for r in runs)
    latency = sum(latencies) / len(latencies)
    return {"source": f"estimated by `python3 runs/bench/host_block.py --traces` from the profiled steps of "
                      f"calibration runs {names} (each primitive's in-context duration in their traces; plain = that "
                      f"times the run's unprofiled / profiled forward ranges, host-bound): a stand-in until a host "
                      f"sweep of this machine (runs/bench/host_sweep_h200.sh) replaces it",
            "cpu": cpu, "torch": read_run(runs[0]).manifest.get("versions", {}).get("torch", "unknown"),
            "launch_latency_s": round(latency, 9),
            "launch_latency_source": (f"the calibration runs {names}: the mean time from a launch call's return to its "
                                      f"kernel's start over the {len(latencies)} kernels of their profiled steps "
                                      f"launched after the {gpu} had gone idle"),
            "seconds": {k: round(median(plain[k]), 9) for k in p.HOST_PRIMITIVES},
            "profiled_seconds": {k: round(median(profiled[k]), 9) for k in p.HOST_PRIMITIVES}}


def sweep_records(path: Path) -> dict[str, list]:
    """A host sweep's records by primitive: a run directory's, or a host_sweep.jsonl's."""
    lines = (path.read_text().splitlines() if path.is_file()
             else [line for f in sorted(path.glob("ranks/rank*/events.jsonl")) for line in f.read_text().splitlines()])
    records = [r for r in (parse_event(json.loads(line)) for line in lines if line.strip()) if r and r.kind == "host"]
    by_op = defaultdict(list)
    for r in records:
        by_op[r.op].append(r)
    return by_op


def medians(by_op: dict[str, list], ops: tuple[str, ...], field: str) -> dict[str, float]:
    """Each primitive's median `field` (seconds, profiled_seconds) over a sweep's records of it."""
    return {k: median(getattr(r, field) for r in by_op[k]) for k in ops}


def with_graphs(block: dict, by_op: dict[str, list], path: Path) -> dict:
    """The block with the graph primitives (a graphed run's replay, its wrapper and backward) of a host sweep that
    timed them alone (its records `by_op`, read from `path`): measured, where the rest of a --traces block is
    estimated from a run without graphs."""
    for key in ("seconds", "profiled_seconds"):
        block[key] |= medians(by_op, p.GRAPH_PRIMITIVES, key)
    block["graphs_source"] = (f"graph_node, graphed_call, graphed_backward measured by the host sweep alone (no "
                              f"training run), {path.name}: `PARTS=sweep bash runs/bench/cuda_graphs_h200.sh`")
    return block


def from_sweep(by_op: dict[str, list], path: Path, gpu: str) -> dict:
    """The block of a host sweep's records (`by_op`, read from `path`) made on `gpu`'s host: their medians."""
    records = [r for rs in by_op.values() for r in rs]
    block = {"source": f"measured by the host sweep (probes/host_sweep.py) of {path.name}, "
                       f"`bash runs/bench/host_sweep_h200.sh` on one {gpu}'s host",
             "cpu": records[0].cpu, "torch": records[0].torch, "launch_latency_s": LAUNCH_LATENCY,
             "launch_latency_source": LATENCY_SOURCE,
             "seconds": medians(by_op, p.HOST_PRIMITIVES, "seconds")}
    if all(r.profiled_seconds is not None for r in records):
        block["profiled_seconds"] = medians(by_op, p.HOST_PRIMITIVES, "profiled_seconds")
    return block


class Refused(ValueError):
    """Inputs that cannot give a block."""


def checked_traces(runs: list[Path]) -> list[Path]:
    """--traces: each a run directory with a profiler trace."""
    for run in runs:
        if not (run / "manifest.json").is_file() or not any((run / "traces").glob("*.json.gz")):
            raise Refused(f"--traces {run}: not a run directory with a profiler trace under traces/")
    return runs


def records_of(flag: str, path: Path, ops: tuple[str, ...]) -> dict[str, list]:
    """A --sweep's or --graphs' host sweep records by primitive, each of `ops` among them."""
    if not path.exists():
        raise Refused(f"{flag} {path}: does not exist")
    try:
        found = sweep_records(path)
    except (OSError, ValueError) as exc:
        raise Refused(f"{flag} {path}: not readable as host sweep records ({exc.__class__.__name__})") from None
    absent = [op for op in ops if not found.get(op)]
    if absent:
        raise Refused(f"{flag} {path}: no host sweep record of {', '.join(absent)}")
    return found


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--traces", nargs="+", type=Path, help="calibration run directories with a profiler trace")
    src.add_argument("--sweep", type=Path, help="a run directory with `host` records, or a host_sweep.jsonl")
    ap.add_argument("--graphs", type=Path, help="with --traces: a host sweep's records (a host_sweep.jsonl) for the "
                                                 "graph primitives")
    ap.add_argument("--gpu", choices=("H200", "H100"), default="H200", help="the GPU whose file --write writes")
    ap.add_argument("--write", action="store_true", help="store the block in ledger/models/hardware/<gpu>.json")
    ap.add_argument("--out", type=Path, help="write the block to this file (a hardware file's `host` entry)")
    args = ap.parse_args(argv)
    try:
        traces = checked_traces(args.traces) if args.traces else None
        sweep = records_of("--sweep", args.sweep, p.HOST_PRIMITIVES) if args.sweep is not None else None
        graphs = records_of("--graphs", args.graphs, p.GRAPH_PRIMITIVES) if args.graphs is not None else {}
    except Refused as exc:
        print(f"host_block.py: {exc}", file=sys.stderr)
        return 2
    cpu = next((r.cpu for rs in graphs.values() for r in rs if r.cpu), f"the {args.gpu} machine's host (not recorded)")
    block = from_traces(traces, args.gpu, cpu) if traces else from_sweep(sweep, args.sweep, args.gpu)
    if args.graphs is not None:
        block = with_graphs(block, graphs, args.graphs)
    print(json.dumps(block, indent=1))
    if args.out:
        args.out.write_text(json.dumps({"host": block}, indent=1) + "\n")
    if args.write:
        path = hardware_file(args.gpu)
        data = json.loads(path.read_text())
        data["host"] = block
        write_hardware_json(path, data)
        print(f"wrote the host block of {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
