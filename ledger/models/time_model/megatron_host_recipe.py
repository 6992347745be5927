"""What Megatron-LM's own code calls on the host (--transformer-impl local, commit 571370c; no Transformer Engine, no
Apex) for each catalogue entry and around the passes, in the host sweep's primitives (common/ops/host.py): the
counterpart of host_recipe.py, read off Megatron's code and the order of its calls in a trace
(tests/test_megatron_host.py holds the launches they imply to the kernels of a real run). docs/formulas.md,
"Megatron-LM's host", lists what each stands for.

What differs from this engine: a linear is three autograd Functions (the copy to or the reduce from the tensor-parallel
region and LinearWithGradAccumulationAndAsyncCommunication); RoPE, SwiGLU and the cross-entropy are chains of eager
ops; the residual add is a compiled bias-dropout-add; the loss is checked for NaN and Inf with two reads of the device
per micro-batch; `get_batch` copies and broadcasts five tensors; the step ends in Megatron's logging, whose reads
(the loss, the grad norm, the learning rate, memory) hold the host until the device drains; at --timing-log-level 2
the timers synchronise the device at each pass's start and end and around the optimizer's parts.
"""
from __future__ import annotations

from collections import Counter

from common.ops import host as p
from ledger.models.time_model import host_recipe
from ledger.models.time_model.host_recipe import Recipe
from ledger.models.time_model.ops import Collective, Work

# Megatron-LM's host time in a step over the sum of its recipes' primitives (its Python between the calls: the
# schedule, the rerun state machine, its modules' hooks), fitted by `python3 runs/bench/host_model.py --calibrate
# tests/fixtures/megatron_lm_1gpu` on that host-bound run's measured step against the H200 file's host block
# (BENCHMARKS.md names the split).
CONTEXT = 2.55

LINEAR_FWD = {p.MODULE: 1, p.FUNCTION: 2, p.GEMM: 1}  # module; region copy or reduce; the linear's Function
LINEAR_DGRAD = {p.AUTOGRAD_NODE: 2, p.FUNCTION: 2, p.GEMM: 1}  # the two Functions' backward nodes
LINEAR_WGRAD = {p.VIEW: 4, p.GEMM: 1}  # the input and grad reshapes, the 16-bit weight gradient
# Without gradient-accumulation fusion: the weight's AccumulateGrad node and DDP's hook adding it to main_grad
MAIN_GRAD_ADD = {p.AUTOGRAD_NODE: 1, p.MODULE: 1, p.EAGER: 1}
ROPE_ONE = {p.VIEW: 3, p.EAGER: 12}  # alias, slice, cos, mul, to, sin, mul, to, mul, chunk, neg, cat, mul, add, cat
ROPE_ONE_BACKWARD = {p.EAGER_BACKWARD: 6, p.LAUNCH: 1, p.AUTOGRAD_NODE: 3}

FORWARD: dict[str, Recipe] = {
    # GPTModel, LanguageModelEmbedding, VocabParallelEmbedding, RotaryEmbedding, TransformerBlock; lookup, transpose,
    # contiguous, dropout
    "embedding.fwd": {p.MODULE: 5, p.EAGER: 2, p.VIEW: 2},
    "rms_norm.fwd": {p.MODULE: 1, p.EAGER: 1},
    # the qkv view and split, q's reshape copy, then q and k rotated
    "rope_unfused.fwd": host_recipe.sum_of({p.VIEW: 2, p.EAGER: 1}, ROPE_ONE, ROPE_ONE),
    "attention.repeat_kv.fwd": {p.EAGER: 2},  # repeat_interleave of k and v
    # DotProductAttention; the views onto the global memory buffer, baddbmm
    "core_attention.scores.fprop": {p.MODULE: 1, p.VIEW: 8, p.GEMM: 1},
    # FusedScaleMaskSoftmax: masked_fill_, softmax; the dropout under the CUDA RNG tracker's fork (CPU ops)
    "core_attention.softmax.fwd": {p.MODULE: 1, p.EAGER: 2, p.VIEW: 4},
    # FusedScaleMaskSoftmax through its fused kernel: the module, the kernel's autograd Function, the views
    "core_attention.softmax_fused.fwd": {p.MODULE: 1, p.FUNCTION: 1, p.LAUNCH: 1, p.VIEW: 4},
    "core_attention.context.fprop": {p.VIEW: 4, p.GEMM: 1},  # views, bmm
    "core_attention.fwd": {p.MODULE: 1, p.VIEW: 5, p.ATTENTION: 1},  # SDPA spec: permutes, SDPA, permute, reshape
    "attention_output.copy": {p.VIEW: 2, p.EAGER: 1},  # permute, contiguous, view
    "residual_add": {p.COMPILED: 1},  # the compiled bias-dropout-add
    "swiglu_unfused.fwd": {p.VIEW: 1, p.EAGER: 3},  # chunk, silu, the offset add, the product
    "swiglu.fwd": {p.COMPILED: 1},  # --bias-swiglu-fusion
    # transpose and contiguous in, _VocabParallelCrossEntropy's eighteen kernels, transpose and contiguous out
    "cross_entropy_fp32.fwd": {p.FUNCTION: 1, p.EAGER: 20, p.VIEW: 2},
}
BACKWARD: dict[str, Recipe] = {
    "embedding.bwd": {p.EAGER_BACKWARD: 1, p.LAUNCH: 2, p.AUTOGRAD_NODE: 2, **MAIN_GRAD_ADD},
    "rms_norm.bwd": {p.EAGER_BACKWARD: 1, p.LAUNCH: 2, **MAIN_GRAD_ADD},  # FusedRmsNormBackward, the weight's hook
    "rope_unfused.bwd": host_recipe.sum_of({p.EAGER_BACKWARD: 1, p.AUTOGRAD_NODE: 3}, ROPE_ONE_BACKWARD,
                                           ROPE_ONE_BACKWARD),
    "attention.repeat_kv.bwd": {p.EAGER_BACKWARD: 2, p.AUTOGRAD_NODE: 6},  # expand's sums; unsqueeze, view, clone
    "core_attention.scores.dgrad": {p.AUTOGRAD_NODE: 4, p.GEMM: 1},  # BaddbmmBackward's two GEMMs; transposes, views
    "core_attention.softmax.bwd": {p.EAGER_BACKWARD: 3, p.LAUNCH: 6},  # softmax's, AsStrided's, CopySlices'
    "core_attention.softmax_fused.bwd": {p.AUTOGRAD_NODE: 1, p.LAUNCH: 1},  # the Function's backward, one kernel
    "core_attention.context.dgrad": {p.AUTOGRAD_NODE: 4, p.GEMM: 1},  # BmmBackward; the output's view and permute
    "core_attention.value.dgrad": {p.GEMM: 1},
    "core_attention.bwd": {p.ATTENTION_BACKWARD: 1, p.AUTOGRAD_NODE: 5},
    "attention_output.copy": {},  # its nodes are core attention's
    "residual_add": {p.COMPILED_BACKWARD: 1},
    "swiglu_unfused.bwd": {p.EAGER_BACKWARD: 3, p.LAUNCH: 1, p.AUTOGRAD_NODE: 1},
    "swiglu.bwd": {p.COMPILED_BACKWARD: 1},
    "cross_entropy_fp32.bwd": {p.AUTOGRAD_NODE: 3, p.FUNCTION: 1, p.EAGER: 8},
}
# A layer's own module calls (TransformerLayer, SelfAttention, the MLP), charged to its first norm
LAYER_START = {p.MODULE: 3}

# get_batch on the first stage: the data iterator, five tensors copied to the device and broadcast over the
# tensor-parallel group (a c10d call even for a group of one)
BATCH = {p.MODULE: 2, p.EAGER: 5, p.FUNCTION: 5}
# loss_func: the mask's product and sums, the reporting clones and their concatenation; then the rerun state
# machine's NaN and Inf checks (each a read), and the schedule's scaling of the loss
LOSS = {p.EAGER: 8, p.VIEW: 8}
LOSS_CHECKS = ({p.EAGER: 1, p.ITEM: 1}, {p.EAGER: 1, p.LAUNCH: 1, p.ITEM: 1})
LOSS_SCALE = {p.EAGER: 5, p.LAUNCH: 1}
# torch.autograd.backward, then the loss's nodes: its product, the two divisions, the sum, the mask's product, views
BACKWARD_START = {p.BACKWARD_CALL: 1, p.EAGER_BACKWARD: 4, p.LAUNCH: 1, p.AUTOGRAD_NODE: 4}
# After the update: the grad-norm and loss reads and training_log's (--log-interval 1: the loss, the learning rate,
# the grad norm, memory, the timers' values gathered), each a read; counted in the calibration run's trace tail
STEP_END_READS = 25
STEP_END = {p.EAGER: 40, p.VIEW: 120, p.FUNCTION: 6}
# --timing-log-level 2: the optimizer's timers (grads reduce-scatter, params all-gather, the update and its parts,
# the whole) synchronise around the update and training_log's timers' barrier
OPTIMIZER_SYNCS = 22


def entry(w: Work, forward: bool) -> Recipe:
    """The host's primitives for one entry of a Megatron-LM pass."""
    if isinstance(w.op, Collective):
        return host_recipe.COLLECTIVE
    name = w.op.name
    if name == "main_grad.add":
        return MAIN_GRAD_ADD
    extra: Counter = Counter()
    if host_recipe.opens_layer(w, forward):
        extra.update(LAYER_START)
    pass_ = name.rsplit(".", 1)[-1]
    if pass_ in ("fprop", "dgrad", "wgrad") and not name.startswith("core_attention."):
        found = {"fprop": LINEAR_FWD, "dgrad": LINEAR_DGRAD, "wgrad": LINEAR_WGRAD}[pass_]
    else:
        found = (FORWARD if forward else BACKWARD).get(name)
    if found is None:
        raise KeyError(f"no Megatron-LM host recipe for {name}")
    extra.update(found)
    return dict(extra)


def forward_start(first_stage: bool) -> Recipe:
    return BATCH if first_stage else {p.MODULE: 2, p.VIEW: 1}


def optimizer(tensors: int, elements: int) -> Recipe:
    """torch's foreach AdamW over the main params (host_recipe.optimizer's foreach passes), Megatron's clip over
    its per-tensor norms and the copy of each main param to its model param."""
    return host_recipe.sum_of(host_recipe.optimizer(tensors, elements), {p.EAGER: 2 * tensors, p.VIEW: 2 * tensors})


def step_start(buffers: int, tensors: int) -> Recipe:
    """zero_grad_buffer (a memset a buffer) and the optimizer's zero_grad over its params."""
    return {p.EAGER: buffers, p.MODULE: 1 + tensors // 10}

