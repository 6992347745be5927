"""The host's side of a rank's operations: the kinds of call the host makes to put the catalogue's work on the device,
each with one fixed cost per call on a given CPU and torch. The host sweep (probes/host_sweep.py) times one of each;
the time model (ledger/models/time_model/host_recipe.py) counts how many of each the engine makes per catalogue entry
and runs a host timeline beside the device's. docs/formulas.md, "Host timeline", derives both.

Each primitive is named for what it is in torch, measured on a tiny tensor so that its kernel (if any) is shorter
than its dispatch, and what it includes is said once here:
  launch            a kernel launch with the least dispatch around it (torch.cuda._sleep(0))
  eager             an eager aten op that allocates its output and launches one elementwise kernel (torch.add)
  gemm              an eager matmul through cuBLAS (torch.matmul), one GEMM kernel
  attention         an eager scaled_dot_product_attention forward (causal), its backend's kernels
  view              an aten op without a kernel (Tensor.view)
  function          a Python torch.autograd.Function's apply with a graph node, its forward one view
  module            a torch.nn.Module call whose forward returns its input (the Python call and hook checks)
  compiled          a torch.compile'd function's call under autograd (guards, the AOT wrapper, one fused kernel)
  autograd_node     one node of a backward pass (a view's backward: the autograd engine's per-node work, no kernel)
  eager_backward    one node of a backward pass that launches one elementwise kernel (a multiply's backward)
  compiled_backward one node of a backward pass through a compiled function (its compiled backward's kernel)
  attention_backward one node of a backward pass through scaled_dot_product_attention (its backward kernels)
  backward_call     torch.autograd.backward's own cost, beyond its nodes (handing the graph to the autograd thread)
  event_record      torch.cuda.Event.record (the timers' probe records two per range)
  sync              torch.cuda.synchronize on an idle device: the round trip
  item              Tensor.item of a device scalar on an idle device: the copy to host and its wait
  graph_node        each kernel node of a replayed CUDA graph: (replay of 33 nodes - replay of 1) / 32
  graphed_call      a make_graphed_callables module of six parameters (a layer's count here) called: the wrapper's
                    Python, the input's copy into its static buffer, the autograd Function, the replay of six nodes
  graphed_backward  one such module's backward node: the incoming gradient's copy, the replay of its twelve nodes,
                    the six gradients returned, each parameter's AccumulateGrad and a hook that drops the gradient
Beside the primitives, a GPU rank's host sweep times its own model's passes (`pass.forward`, `pass.backward`: the
host's seconds to issue one micro-batch's forward through the loss, and its backward, on the run's shapes, the device
drained before each and never waited for inside): the engine's calls in their real context, where the primitives'
microbenchmark sees none of the Python between them (engine/probe_adapters.pass_timer).
The three graph primitives price --cuda-graph-impl local's replays; a host sweep from before they existed lacks them,
which only a graphed run needs (GRAPH_PRIMITIVES, apart from HOST_PRIMITIVES).
A CPU rank has no launches (ops run on the calling thread): its host sweep times the primitives that exist there
(eager, gemm, attention, view, function, module, the backward nodes, backward_call, item) and says so.
"""
from __future__ import annotations

LAUNCH = "launch"
EAGER = "eager"
GEMM = "gemm"
ATTENTION = "attention"
VIEW = "view"
FUNCTION = "function"
MODULE = "module"
COMPILED = "compiled"
AUTOGRAD_NODE = "autograd_node"
EAGER_BACKWARD = "eager_backward"
COMPILED_BACKWARD = "compiled_backward"
ATTENTION_BACKWARD = "attention_backward"
BACKWARD_CALL = "backward_call"
EVENT_RECORD = "event_record"
SYNC = "sync"
ITEM = "item"
GRAPH_NODE = "graph_node"
GRAPHED_CALL = "graphed_call"
GRAPHED_BACKWARD = "graphed_backward"
# The stand-in layer the two graphed primitives time: its parameters, its forward's and its backward's kernel nodes.
GRAPHED_PARAMS, GRAPHED_FORWARD_NODES, GRAPHED_BACKWARD_NODES = 6, 6, 12
HOST_PRIMITIVES = (LAUNCH, EAGER, GEMM, ATTENTION, VIEW, FUNCTION, MODULE, COMPILED, AUTOGRAD_NODE, EAGER_BACKWARD,
                   COMPILED_BACKWARD, ATTENTION_BACKWARD, BACKWARD_CALL, EVENT_RECORD, SYNC, ITEM)
GRAPH_PRIMITIVES = (GRAPH_NODE, GRAPHED_CALL, GRAPHED_BACKWARD)
PASS_FORWARD = "pass.forward"
PASS_BACKWARD = "pass.backward"
# The forward again after the host has slept (IDLE_BEFORE_PASS_S): what a step's first micro-batch follows, the step
# end's waits for the device, which leave the host issuing it ~1.6x slower than straight after another pass
PASS_FORWARD_AFTER_IDLE = "pass.forward_after_idle"
IDLE_BEFORE_PASS_S = 0.02
# What a CPU rank cannot do: launch, compile (the engine's jit_fuser runs eagerly off CUDA), record device events,
# synchronise a stream.
DEVICE_ONLY = (LAUNCH, COMPILED, COMPILED_BACKWARD, EVENT_RECORD, SYNC, *GRAPH_PRIMITIVES)
