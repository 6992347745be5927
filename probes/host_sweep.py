"""The start-up host sweep (--host-sweep, part of --all-probes): the host's seconds per call of each primitive of
common/ops/host.py on this rank's device, with this CPU and torch; under torch.profiler too where the run has a
profiler window (the time model prices a profiled step's host with those). The time model's host timeline counts
the primitives per catalogue entry (ledger/models/time_model/host_recipe.py) and prices them with these records.

A call's host time is the wall time of `calls` calls back to back (SIZES), the device drained before (untimed) and never
waited for inside: on tiny tensors each kernel is shorter than its dispatch, so the queue stays short and the figure
is the host's. A backward primitive is a node's share of a chain's backward: (time of `chain` nodes - time of one)
/ (chain - 1), so the backward call's own cost (`backward_call`, the time of one less that share) is apart. Each
figure is the median of `repeats` repeats. docs/formulas.md, "Host timeline", says what each primitive stands for.
On a GPU the sweep also replays CUDA graphs (a graph's nodes; a make_graphed_callables stand-in layer's call and
backward) and, given the engine's pass timer, the model's own forward and backward issue (pass.forward,
pass.backward), which the time model sets against the recipes' prices of the same calls.
"""
from __future__ import annotations

import platform
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from common.ops import host as prim
from probes.graph_capture import capture_stream_mismatch_quiet
from probes.profiler import torch_profile

# (calls, repeats, chain nodes, warm-up calls): a CPU rank's primitives compute on the calling thread, so fewer calls
# say as much (and a CPU test run's start-up stays short).
SIZES = {"cuda": (100, 5, 32, 3), "cpu": (10, 3, 8, 1)}
CPU_NOTE = "CPU rank: ops run on the calling thread, no kernel launch (no launch, compile, event or stream sync)"


class _Identity(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad


class _Pass(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def cpu_model() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux), else what platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


GRAPH_NODES = 33  # the longer graph's kernels: graph_node is the replay's cost per node beyond the first


def _graph(x: torch.Tensor, nodes: int) -> torch.cuda.CUDAGraph:
    """A captured graph of `nodes` tiny in-place kernels on x (captured before any profiler starts)."""
    stream = torch.cuda.Stream(x.device)
    with torch.cuda.stream(stream):  # warm-up outside the capture, as make_graphed_callables does
        x.add_(1.0)
    torch.cuda.current_stream(x.device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(nodes):
            x.add_(1.0)
    return graph


class _Scales(torch.nn.Module):
    """The graphed primitives' stand-in layer: prim.GRAPHED_PARAMS parameters, one multiply each (six kernels
    forward, twelve backward: each multiply's input and weight gradients)."""

    def __init__(self, like: torch.Tensor):
        super().__init__()
        self.w = torch.nn.ParameterList(torch.nn.Parameter(torch.ones_like(like)) for _ in range(prim.GRAPHED_PARAMS))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for w in self.w:
            x = x * w
        return x


def _drop_grad(param: torch.Tensor) -> None:  # as DDP's hook does once it has taken the gradient
    param.grad = None


def _graphed_layers(x: torch.Tensor, count: int) -> tuple[torch.nn.Module, ...]:
    """`count` stand-in layers, each captured by make_graphed_callables (one pool), gradients dropped by a hook."""
    layers = tuple(_Scales(x) for _ in range(count))
    samples = tuple((x.detach().clone().requires_grad_(True),) for _ in layers)
    graphed = torch.cuda.make_graphed_callables(layers, samples, num_warmup_iters=1)
    for layer in graphed:
        for w in layer.parameters():
            w.grad = None
            w.register_post_accumulate_grad_hook(_drop_grad)
    return graphed


def seconds_per_call(call: Callable[[], Any], calls: int, repeats: int, warmup: int,
                     drain: Callable[[], None]) -> float:
    """The host's seconds per call of `call`: the median over `repeats` laps of `calls` calls back to back, after
    `warmup` calls, the device drained (`drain`) before each lap and never waited for inside one."""
    for _ in range(warmup):
        call()
    drain()
    laps = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            call()
        laps.append((time.perf_counter() - t0) / calls)
        drain()
    return statistics.median(laps)


class _Bench:
    """Tiny tensors on one device and the timing of calls and backward chains on them."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"
        self.dtype = torch.bfloat16 if self.cuda else torch.float32
        self.x = torch.randn(256, device=device, dtype=self.dtype)
        self.a = torch.randn(64, 64, device=device, dtype=self.dtype)
        self.q = torch.randn(1, 2, 64, 64, device=device, dtype=self.dtype)
        self.calls, self.repeats, self.chain, self.warmup = SIZES["cuda" if self.cuda else "cpu"]
        # One compiled function for every measurement (a compile takes seconds): one fused kernel each way.
        self.compiled = torch.compile(lambda t: t * 2.0 + 1.0, fullgraph=True) if self.cuda else None
        self.graphs = (_graph(self.x.clone(), 1), _graph(self.x.clone(), GRAPH_NODES)) if self.cuda else ()
        with torch.enable_grad(), capture_stream_mismatch_quiet():
            self.graphed = _graphed_layers(self.x, self.chain) if self.cuda else ()

    def drain(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def per_call(self, call: Callable[[], Any]) -> float:
        return seconds_per_call(call, self.calls, self.repeats, self.warmup, self.drain)

    def backward_seconds(self, build: Callable[[int], torch.Tensor], nodes: int) -> float:
        """Median host time of the backward of a chain of `nodes` nodes (the forward untimed)."""
        laps = []
        for i in range(self.warmup + self.repeats):
            out = build(nodes)
            grad = torch.ones_like(out)
            self.drain()
            t0 = time.perf_counter()
            out.backward(grad)
            if i >= self.warmup:
                laps.append(time.perf_counter() - t0)
            self.drain()
        return statistics.median(laps)

    def per_node(self, build: Callable[[int], torch.Tensor]) -> float:
        return max(0.0, (self.backward_seconds(build, self.chain) - self.backward_seconds(build, 1)) / (self.chain - 1))

    def leaf(self, t: torch.Tensor) -> torch.Tensor:
        return t.detach().clone().requires_grad_(True)


def _chain(step: Callable[[torch.Tensor], torch.Tensor], start: Callable[[], torch.Tensor]) -> Callable:
    def build(nodes: int) -> torch.Tensor:
        out = start()
        for _ in range(nodes):
            out = step(out)
        return out
    return build


def _calls(b: _Bench) -> dict[str, Callable[[], Any]]:
    """The forward primitives, each one call."""
    x, y, a, scalar = b.x, b.x.clone(), b.a, b.x.sum()
    q = b.leaf(b.q)
    grad_x = b.leaf(x)
    module = _Pass()
    calls: dict[str, Callable[[], Any]] = {
        prim.EAGER: lambda: torch.add(x, y), prim.GEMM: lambda: torch.matmul(a, a),
        prim.ATTENTION: lambda: F.scaled_dot_product_attention(q, q, q, is_causal=True),
        prim.VIEW: lambda: x.view(16, 16), prim.FUNCTION: lambda: _Identity.apply(grad_x),
        prim.MODULE: lambda: module(x), prim.ITEM: lambda: scalar.item()}
    if b.cuda:
        calls.update({prim.LAUNCH: lambda: torch.cuda._sleep(0), prim.COMPILED: lambda: b.compiled(grad_x),
                      prim.EVENT_RECORD: lambda: torch.cuda.Event(enable_timing=True).record(),
                      prim.SYNC: lambda: torch.cuda.synchronize(b.device)})
    return calls


def _chains(b: _Bench) -> dict[str, Callable[[int], torch.Tensor]]:
    """The backward primitives, each a chain builder of n nodes of its kind."""
    chains = {prim.AUTOGRAD_NODE: _chain(lambda t: t.view(-1), lambda: b.leaf(b.x)),
              prim.EAGER_BACKWARD: _chain(lambda t: t * 1.0001, lambda: b.leaf(b.x)),
              prim.ATTENTION_BACKWARD: _chain(lambda t: F.scaled_dot_product_attention(t, t, t, is_causal=True),
                                              lambda: b.leaf(b.q))}
    if b.cuda:
        chains[prim.COMPILED_BACKWARD] = _chain(b.compiled, lambda: b.leaf(b.x))
    return chains


def _graphed(b: _Bench) -> dict[str, float]:
    """graph_node: each further node's share of a 33-node replay over a one-node one; graphed_call: a stand-in
    layer's call on a new input (copied in, as a layer's always is); graphed_backward: one node of a chain of them."""
    one, many = b.graphs
    node = max(0.0, (b.per_call(many.replay) - b.per_call(one.replay)) / (GRAPH_NODES - 1))
    first, x = b.graphed[0], b.leaf(b.x)

    def chain(nodes: int) -> torch.Tensor:
        out = b.leaf(b.x)
        for layer in b.graphed[:nodes]:
            out = layer(out)
        return out
    return {prim.GRAPH_NODE: node, prim.GRAPHED_CALL: b.per_call(lambda: first(x)),
            prim.GRAPHED_BACKWARD: b.per_node(chain)}


def _measure(b: _Bench) -> dict[str, float]:
    calls = _calls(b)
    seconds = {name: b.per_call(call) for name, call in calls.items()}
    if b.cuda:
        with capture_stream_mismatch_quiet():
            seconds.update(_graphed(b))
    chains = _chains(b)
    seconds.update({name: b.per_node(build) for name, build in chains.items()})
    view_chain = chains[prim.AUTOGRAD_NODE]
    seconds[prim.BACKWARD_CALL] = max(0.0, b.backward_seconds(view_chain, 1) - seconds[prim.AUTOGRAD_NODE])
    return seconds


def run(device: torch.device, profiled: bool,
        passes: Callable[[], dict[str, float]] | None = None) -> list[dict[str, Any]]:
    """This rank's `host` records: every primitive the device has, timed plain and (profiled) under the profiler;
    `passes`, on a GPU rank: the seconds to issue the model's own passes (pass.forward, pass.backward)."""
    bench = _Bench(device)
    timed_passes = passes if passes is not None and bench.cuda else None
    with torch.enable_grad():
        plain = _measure(bench) | (timed_passes() if timed_passes else {})
        under = {}
        if profiled:
            with torch_profile():
                under = _measure(bench) | (timed_passes() if timed_passes else {})
    launches = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if launches else "cpu"
    common = {"iters": bench.calls * bench.repeats, "launches": launches, "device": name, "cpu": cpu_model(),
              "torch": torch.__version__, "threads": torch.get_num_threads(),
              **({} if launches else {"note": CPU_NOTE})}
    return [{"op": op, "seconds": plain[op], **({"profiled_seconds": under[op]} if op in under else {}), **common}
            for op in (*prim.HOST_PRIMITIVES, *prim.GRAPH_PRIMITIVES, prim.PASS_FORWARD, prim.PASS_BACKWARD,
                       prim.PASS_FORWARD_AFTER_IDLE)
            if op in plain]
