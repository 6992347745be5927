"""What the engine's host calls to run each entry of a pass, and around the passes: counts of the host sweep's
primitives (common/ops/host.py), read off the engine's code (docs/formulas.md, "Host timeline", lists each with the
code it stands for; tests/test_host_model.py holds the launches they imply to the kernels of a real trace).

    entry(w, forward)          one catalogue entry of a pass (ops.py Work): its module calls, autograd Function,
                               eager ops, compiled region, views; in backward its autograd nodes and the DDP hooks
    forward_start, ...         one micro-batch's forward or backward beyond its entries: the batch and its copy to
                               the device, the model's call, the loss, torch.autograd.backward; a probe range
    optimizer, step_start, ... the optimizer step (foreach launches by elements), zero_grad, the loss's reduction
A recipe prices the host; the device's time is the compute sweep's. CONTEXT is what the engine's Python around these
calls adds, fitted once (runs/bench/host_model.py on the calibration runs BENCHMARKS.md names). The recipes describe
this engine's code only; megatron_host_recipe.py describes Megatron-LM's local layers, and where neither applies
(unmodelled_host says so) the time model runs on the device's clock alone.
"""
from __future__ import annotations

from collections import Counter
from typing import Mapping

from common.config import RunConfig
from common.ops import host as p
from common.ops.rank import into_main_grad
from ledger.models.time_model.host_costs import HostCosts
from ledger.models.time_model.ops import Collective, Work

Recipe = Mapping[str, float]

# The engine's host time in a step over the sum of its recipes' primitives (Python between the calls, allocator and
# cache effects a microbenchmark does not see): fitted by `python3 runs/bench/host_model.py --calibrate
# tests/fixtures/h200_2layer_profiled` on that run's measured step against the H200 file's host block
# (BENCHMARKS.md, "The host timeline", names the split).
CONTEXT = 1.40

LINEAR_FWD = {p.MODULE: 1, p.FUNCTION: 1, p.GEMM: 1, p.VIEW: 1}  # module, _LinearWithGradAccumulation, x W^T
LINEAR_DGRAD = {p.AUTOGRAD_NODE: 1, p.FUNCTION: 1, p.GEMM: 1}  # the node runs the Function's Python backward
# The wgrad's reshapes and transpose, its GEMM into main_grad, the placeholder grad; the weight's AccumulateGrad node
# and DDP's post-accumulate hook (Python, no add: the GEMM accumulated).
LINEAR_WGRAD = {p.VIEW: 4, p.GEMM: 1, p.AUTOGRAD_NODE: 1, p.MODULE: 1}
NORM_GRAD_HOOK = {p.AUTOGRAD_NODE: 1, p.MODULE: 1, p.EAGER: 1}  # a norm weight's AccumulateGrad: the hook's add_

FORWARD: dict[str, Recipe] = {
    "rms_norm.fwd": {p.MODULE: 1, p.EAGER: 1}, "layer_norm.fwd": {p.MODULE: 1, p.EAGER: 1},
    "rope.fwd": {p.VIEW: 1, p.COMPILED: 1, p.LAUNCH: 2},  # qkv.view, split_qkv_and_rotate: three kernels
    "core_attention.fwd": {p.VIEW: 3, p.ATTENTION: 1},  # q, k, v permutes, SDPA
    # permute, then reshape: a view of SDPA's output (its layout is already [s, b, heads, d]; no kernel in a trace)
    "attention_output.copy": {p.VIEW: 2},
    "residual_add": {p.EAGER: 1},
    "swiglu.fwd": {p.COMPILED: 1}, "gelu.fwd": {p.EAGER: 1},
    "embedding.fwd": {p.MODULE: 3, p.VIEW: 1, p.EAGER: 1},  # GPTModel, embedding, rotary modules; ids.t(), lookup
    # _VocabParallelCrossEntropy: the Function, two compiled passes (the second two kernels), the target masks and
    # the loss's arithmetic
    "cross_entropy.fwd": {p.FUNCTION: 1, p.COMPILED: 2, p.LAUNCH: 1, p.EAGER: 8},
    # MoE (engine/transformer/moe). Routing: top-k, the softmax in fp32, counts, kept / dropped, the load-balancing
    # loss (softmax, mean, fractions, product, sum) attached by a Function, the routing record's three adds
    "router.topk.fwd": {p.EAGER: 16, p.FUNCTION: 1, p.VIEW: 1},
    # dispatch: the sort key, argsort, counts, the slot rows, counts.tolist() (a read of the device), the gather
    "moe.permute.fwd": {p.EAGER: 9, p.VIEW: 4, p.ITEM: 1},
    # the experts' cat, then unpermute compiled (engine/jit.py): its zero row's cat, the gather-weight-sum; the view
    "moe.unpermute.fwd": {p.EAGER: 1, p.COMPILED: 1, p.LAUNCH: 1, p.VIEW: 1},
    "ring_attention.merge.fwd": {p.EAGER: 6},
}
BACKWARD: dict[str, Recipe] = {
    "rms_norm.bwd": {p.EAGER_BACKWARD: 1, p.LAUNCH: 1, **NORM_GRAD_HOOK},  # input and weight grads
    "layer_norm.bwd": {p.EAGER_BACKWARD: 1, p.LAUNCH: 1, **NORM_GRAD_HOOK},
    "rope.bwd": {p.COMPILED_BACKWARD: 1, p.AUTOGRAD_NODE: 4},  # and the view and q, k, v permutes' nodes
    "core_attention.bwd": {p.ATTENTION_BACKWARD: 1, p.AUTOGRAD_NODE: 2},  # and the output's permute and view nodes
    "residual_add": {p.AUTOGRAD_NODE: 1, p.EAGER: 1},  # AddBackward, the two branches' grads summed
    "swiglu.bwd": {p.COMPILED_BACKWARD: 1}, "gelu.bwd": {p.EAGER_BACKWARD: 1},
    # --no-gradient-accumulation-fusion: DDP's hook adds the 16-bit wgrad (the node and the hook are LINEAR_WGRAD's)
    "main_grad.add": {p.EAGER: 1},
    "embedding.bwd": {p.EAGER_BACKWARD: 1, p.LAUNCH: 4, p.AUTOGRAD_NODE: 1, **NORM_GRAD_HOOK},  # dense backward
    "cross_entropy.bwd": {p.AUTOGRAD_NODE: 1, p.FUNCTION: 1, p.COMPILED: 1, p.EAGER_BACKWARD: 2},  # and the mean's
    # the aux loss's Function and its nodes, the softmax's and top-k's backward (a scatter)
    "router.topk.bwd": {p.FUNCTION: 1, p.EAGER: 1, p.EAGER_BACKWARD: 9, p.AUTOGRAD_NODE: 2},
    "moe.permute.bwd": {p.EAGER_BACKWARD: 1, p.LAUNCH: 1, p.AUTOGRAD_NODE: 1},  # the gather's index_put
    # the compiled backward (the rows' zeros, the scatter and the probabilities' sum), the view's and the cat's nodes
    "moe.unpermute.bwd": {p.COMPILED_BACKWARD: 1, p.LAUNCH: 1, p.AUTOGRAD_NODE: 2},
    "ring_attention.merge.bwd": {p.EAGER_BACKWARD: 4},
}
# The lookup through _EmbeddingWithGradAccumulation (tensor_parallel/layers.py): forward, the Function around the
# lookup; backward, its node runs the Function's Python (the rows' reshape and cast, index_put_'s sort and
# accumulation), then the weight's AccumulateGrad node and DDP's hook with no gradient to add.
EMBEDDING_INTO_MAIN_GRAD = {"embedding.fwd": {p.MODULE: 3, p.VIEW: 1, p.FUNCTION: 1, p.EAGER: 1},
                            "embedding.bwd": {p.AUTOGRAD_NODE: 2, p.FUNCTION: 1, p.VIEW: 2, p.EAGER: 1, p.LAUNCH: 4,
                                              p.MODULE: 1}}
# A layer's own module calls (TransformerLayer, SelfAttention, the MLP or MoE layer), charged to its first entry.
LAYER_START = {p.MODULE: 3}
EXPERT_START = {p.MODULE: 1, p.VIEW: 1}  # an expert's MLP module and its slice of the rows
# --moe-pad-expert-rows N (experts.py SequentialMLP._expert): F.pad of the expert's rows (the padded tensor's fill and
# the rows' copy) and the output's slice; in backward the slice's node (zeros of the padded size, the rows' copy) and
# the pad's (the rows cut out: a copy). Priced for every expert: a routed count is a multiple of N once in N.
PAD_ROWS_FWD = {p.EAGER: 1, p.LAUNCH: 1, p.VIEW: 1}
PAD_ROWS_BWD = {p.AUTOGRAD_NODE: 2, p.EAGER_BACKWARD: 2, p.LAUNCH: 1}
# At EP 1 under --moe-grouped-gemm the dispatcher keeps the counts on the device: its permute reads nothing back.
PERMUTE_COUNTS_ON_DEVICE = {p.EAGER: 9, p.VIEW: 4}
# --moe-grouped-gemm (engine/transformer/moe/experts.py GroupedMLP, grouped_gemm_util.py): the module's call and the
# rows' groups from the device counts (ExpertGroups.of: the cumsum, the int32 offsets, the pinned buffer and the
# counts' copy into it, the event behind it), charged to linear_fc1's fprop; each fprop is the Function's call, the
# weights' view (detach, as_strided), the grouped GEMM on its transpose; its backward node runs the Function's
# backward: the dgrad GEMM on the view, then (fc2's: the layer's first) the counts' copy read; each expert's wgrad
# after it is a linear's entry (LINEAR_WGRAD: its rows' two slices instead of reshapes). Under
# --moe-delay-expert-wgrad the backward reads nothing: the flush reads each layer and micro-batch's copy
# (delayed_wgrad). A capacity factor's masks (torch.where on the rows in and out) are not counted.
GROUPED_START = {p.MODULE: 1, p.EAGER: 4, p.EVENT_RECORD: 1}
GROUPED = {"fprop": {p.FUNCTION: 1, p.VIEW: 3, p.GEMM: 1}, "dgrad": {p.AUTOGRAD_NODE: 1, p.FUNCTION: 1, p.VIEW: 4,
                                                                     p.GEMM: 1}}
COUNTS_READ = {p.EAGER: 1}  # the copy's event and its tolist (the wait for the event is the timeline's)
COLLECTIVE = {p.FUNCTION: 1, p.LAUNCH: 1}  # a c10d call on the compute stream and its NCCL launch (assumed)

# The kernels each primitive launches on an H200 (cuDNN's SDPA: a memset and its forward kernel; six backward): what
# a graphed layer's replay holds, and what tests/test_host_model.py holds the recipes to against a real trace.
KERNELS = {p.LAUNCH: 1, p.EAGER: 1, p.GEMM: 1, p.COMPILED: 1, p.EAGER_BACKWARD: 1, p.COMPILED_BACKWARD: 1,
           p.ATTENTION: 2, p.ATTENTION_BACKWARD: 6, p.GRAPH_NODE: 1, p.GRAPHED_CALL: p.GRAPHED_FORWARD_NODES,
           p.GRAPHED_BACKWARD: p.GRAPHED_BACKWARD_NODES}


def launched(counts: Recipe) -> int:
    """The kernels a recipe's primitives launch."""
    return int(sum(n * KERNELS.get(k, 0) for k, n in counts.items()))


UNSUPPORTED_MEGATRON = ("host timeline off: the host recipes describe this engine's code and Megatron-LM's local "
                        "layers (ledger/models/time_model/megatron_host_recipe.py), not {what}")


def unmodelled_host(cfg: RunConfig) -> str | None:
    """Why no recipes price cfg's host (Megatron-LM's Transformer Engine layers, its MoE), None when they do."""
    impl = cfg.implementation
    if not impl.megatron:
        return None
    if impl.transformer_impl != "local":
        return UNSUPPORTED_MEGATRON.format(what=f"--transformer-impl {impl.transformer_impl}")
    return UNSUPPORTED_MEGATRON.format(what="its mixture of experts") if cfg.model.is_moe else None


def opens_layer(w: Work, forward: bool) -> bool:
    """Whether w is a layer's first forward entry (its input norm), which carries the layer's own module calls."""
    return forward and w.param is not None and w.param.endswith("input_layernorm.weight")


def entry(w: Work, forward: bool, counts_on_device: bool = False, padded_experts: bool = False,
          delayed_experts: bool = False) -> Recipe:
    """The host's primitives for one entry of a pass; counts_on_device: an MoE layer whose dispatcher keeps its
    counts on the device (--moe-grouped-gemm at EP 1); padded_experts: SequentialMLP's experts pad their rows
    (--moe-pad-expert-rows; in an MoE model every linear_fc1 is an expert's); delayed_experts: the experts' wgrads
    wait for the flush (--moe-delay-expert-wgrad)."""
    if isinstance(w.op, Collective):
        return COLLECTIVE
    name = w.op.name
    if name.startswith("experts."):
        return _grouped(w, delayed_experts)
    extra: Counter = Counter()
    if opens_layer(w, forward):
        extra.update(LAYER_START)
    if forward and w.param is not None and ".experts." in w.param and w.param.endswith("linear_fc1.weight"):
        extra.update(EXPERT_START)
    if padded_experts and name == ("linear_fc1.fprop" if forward else "linear_fc1.dgrad"):
        extra.update(PAD_ROWS_FWD if forward else PAD_ROWS_BWD)
    if counts_on_device and name == "moe.permute.fwd":
        return sum_of(extra, PERMUTE_COUNTS_ON_DEVICE)
    if into_main_grad(w.op):
        return EMBEDDING_INTO_MAIN_GRAD[name]
    found = _linear(name) if name.rsplit(".", 1)[-1] in ("fprop", "dgrad", "wgrad") else None
    recipe = found or (FORWARD if forward else BACKWARD).get(name) or FORWARD.get(name) or BACKWARD.get(name)
    if recipe is None:
        raise KeyError(f"no host recipe for {name}")
    extra.update(recipe)
    return extra


# The MoE router's GEMM is a plain F.linear (engine/transformer/moe/router.py): no Function, and its weight gradient
# goes through autograd's AccumulateGrad and DDP's hook adds it.
ROUTER = {"fprop": {p.MODULE: 1, p.GEMM: 1, p.VIEW: 1}, "dgrad": {p.AUTOGRAD_NODE: 1, p.GEMM: 1},
          "wgrad": {p.GEMM: 1, p.VIEW: 1, **NORM_GRAD_HOOK}}


def _grouped(w: Work, delayed: bool) -> Recipe:
    """A grouped expert GEMM's (GROUPED; the experts' wgrads are linears', LINEAR_WGRAD)."""
    pass_ = w.op.name.rpartition(".")[2]
    if w.op.name == "experts.linear_fc2.dgrad" and not delayed:
        return sum_of(GROUPED[pass_], COUNTS_READ)
    return sum_of(GROUPED_START, GROUPED[pass_]) if w.op.name == "experts.linear_fc1.fprop" else GROUPED[pass_]


def _linear(name: str) -> Recipe:
    head, _, pass_ = name.rpartition(".")
    return (ROUTER if head == "router" else {"fprop": LINEAR_FWD, "dgrad": LINEAR_DGRAD, "wgrad": LINEAR_WGRAD})[pass_]


def probe_range(timers: bool) -> Recipe:
    """One probe range (probes.probe_set): NVTX and record_function in and out, two CUDA events under --timers."""
    return {p.MODULE: 2, **({p.EVENT_RECORD: 2} if timers else {})}


def forward_start(first_stage: bool) -> Recipe:
    """A micro-batch's forward after its range opens, before its first entry: next(batch) and its copy to the
    device (tokens and labels), the DDP wrapper's and the model's calls; a later stage takes its input instead."""
    return {p.EAGER: 2, p.VIEW: 2, p.MODULE: 2} if first_stage else {p.MODULE: 2, p.VIEW: 1}


def forward_end(last_stage: bool) -> Recipe:
    """After the last entry: the loss's float().mean() and division by the micro-batch count (last stage)."""
    return {p.EAGER: 3} if last_stage else {}


BACKWARD_START = {p.BACKWARD_CALL: 1}  # torch.autograd.backward on the micro-batch's loss
MODEL_CALL = {p.MODULE: 2}  # the DDP wrapper's and the model's calls (forward_start's), where a measured forward begins


# torch's multi_tensor_apply: up to 110 tensors and 320 blocks of 65,536 elements a launch (a foreach pass).
FOREACH_TENSORS, FOREACH_ELEMENTS = 110, 320 * 65_536


def foreach_launches(tensors: int, elements: int) -> int:
    """Launches of one foreach pass over `tensors` tensors of `elements` elements in all."""
    return max(-(-tensors // FOREACH_TENSORS), -(-elements // FOREACH_ELEMENTS))


def optimizer(tensors: int, elements: int) -> Recipe:
    """optimizer.step (engine/optimizer): the grad views, _foreach_norm and the norm's arithmetic, the clip's
    coefficient and _foreach_mul_, fused AdamW (a step-counter add per param group, then the update), the copy to
    the model params: four foreach passes, two counter launches, eleven eager ops, the Python over every main param
    (the optimizer range's own cost apart)."""
    return {p.LAUNCH: 4 * foreach_launches(tensors, elements) + 2, p.EAGER: 11, p.VIEW: 2 * tensors,
            p.MODULE: tensors}


def delayed_wgrad(weights: int, counts_reads: int = 0) -> Recipe:
    """flush_delayed_weight_grads (engine/tensor_parallel/layers.py): per delayed weight the held pairs' two cats,
    the transpose and the wgrad GEMM into main_grad, over the Python of every parameter it looks at; and where the
    held rows are grouped experts' with the counts on the device, `counts_reads` copies read (one a layer and
    micro-batch)."""
    return sum_of({p.EAGER: 2 * weights, p.VIEW: weights, p.GEMM: weights, p.MODULE: weights},
                  {p.EAGER: COUNTS_READ[p.EAGER] * counts_reads})


def step_start(buffers: int, tensors: int, timers: bool) -> Recipe:
    """zero_grad_buffer (one memset a buffer), the optimizer's zero_grad (Python over its main params), the
    iteration range."""
    return sum_of(probe_range(timers), {p.EAGER: buffers, p.MODULE: 1 + tensors // 10})


def step_end(pipelined: bool) -> Recipe:
    """After the grad-norm read: the scheduler's step, reduce_loss (stack, mean; a broadcast under PP)."""
    return {p.MODULE: 2, p.EAGER: 2 + (2 if pipelined else 0)}


def sum_of(*recipes: Recipe) -> Recipe:
    """The recipes' counts added."""
    out: Counter = Counter()
    for r in recipes:
        out.update(r)
    return dict(out)


# --cuda-graph-impl local (engine/transformer/cuda_graphs.py): a graphed layer's pass is the host sweep's stand-in
# layer's (graphed_call, graphed_backward: the wrapper, the copies, the replay, the parameters' AccumulateGrad and a
# hook), its replay's nodes beyond the stand-in's at graph_node each, and around it: forward, the layer's forward
# pre-hook (the fused weights' flags); backward, DDP's hook adding each norm's gradient into main_grad (the linears'
# weight-gradient GEMMs add inside the graph), the hooks' Python for parameters beyond the stand-in's six.


def graphed_layer(work: list[Work], forward: bool) -> Recipe:
    """The host's primitives for one graphed layer's pass over the kernels its eager entries launch."""
    kernels = sum(launched(entry(w, forward)) for w in work)
    if forward:
        return {p.GRAPHED_CALL: 1, p.GRAPH_NODE: kernels - p.GRAPHED_FORWARD_NODES, p.MODULE: 1}
    params = [w for w in work if w.param is not None]
    added = sum(1 for w in params if not w.op.name.endswith(".wgrad"))  # the norms' hook adds, outside the graph
    return {p.GRAPHED_BACKWARD: 1, p.GRAPH_NODE: kernels - added - p.GRAPHED_BACKWARD_NODES, p.EAGER: added,
            p.MODULE: len(params) - p.GRAPHED_PARAMS}


def unpriced_host(cfg: RunConfig, host: HostCosts | None) -> str | None:
    """Why `host` cannot price cfg's host (a graphed run priced by a host sweep from before the graph primitives),
    None when it can."""
    if host is None or not cfg.implementation.graphed_layers:
        return None
    absent = [op for op in p.GRAPH_PRIMITIVES if op not in host.seconds]
    return f"host timeline off: the host costs have no {', '.join(absent)} (a graphed run)" if absent else None
