"""The moments of a step when one stage's allocator holds the most beyond its static state, each as activations the
micro-batches in flight keep plus named transients; the peak is the largest (docs/formulas.md, "The peak's
phases").

This engine: the saved activations at the schedule's peak (activations.stage_activation_bytes) and on the last
stage the loss's and the output layer's backwards (output_backward); its dense runs' measured peaks equal static +
the largest within 0.2% (tests/test_peak_phases_h200.py). Under --moe-delay-expert-wgrad two more, as every backward
leaves its experts' weight-gradient operands held (activations.delayed_wgrad_bytes):
  last steady backward  the schedule's peak with the operands of every backward before the stage's last forward,
                        and on the last stage its loss's and output layer's backwards with them held (and the
                        grouped experts' fc1 backward, grouped_fc1_backward, which peaks without the delay too)
  delayed wgrads        after the last backward: every chunk-micro-batch's operands, and the flush's largest
                        concatenation beside them (activations.delayed_wgrad_flush_bytes)
Megatron-LM's layers (implementation transformer_impl local or transformer_engine):
  loss forward          the last stage's micro-batch at its cross-entropy: every layer's saved tensors, the fp32
                        softmax the loss keeps, and the 16-bit logits beside it (GPTModel.forward still holds them)
  core attention fwd    a chunk's last layer inside core attention (walked over the schedule: activations.held_chunks;
                        none on a stage without layers): the earlier layers' saved tensors, this one's
                        up to core attention, the scores DotProductAttention.forward still holds, and the QKV
                        output its caller's views keep referenced
  core attention bwd    the same layer's core attention in backward (core_attention.backward_transient): the MLP's,
                        the loss's and this layer's probabilities and repeated v already freed
  backward of a group   full recompute's rebuilt group (activations.stage_activation_bytes' in-backward term)
  optimizer step        no activations; torch's foreach AdamW allocates a 4-byte temporary (the sqrt of exp_avg_sq)
                        per element of its largest param group, taken here as every element the rank owns (the
                        norms' group is tiny)
Every micro-batch in flight keeps the dataloader's attention mask while masked_fill_ holds it (core_attention),
except where Megatron-LM's rerun data iterator keeps the iteration's batches anyway (kept_batch_bytes, counted between
steps with the other persistent terms: docs/formulas.md, "The iteration's batches").
"""
from __future__ import annotations

from dataclasses import dataclass, field

from common.config import RunConfig
from common.config.implementation_config import FOREACH_ADAM
from common.config.pipeline_layers import stage_num_layers
from common.ops.shapes import ExpertShapes
from common.ops.sizes import DTYPE_BYTES, local_seq_length, vocab_shard
from ledger.models.formulas import activations, core_attention, megatron_layer
from ledger.models.formulas.static_memory import owned_per_dp_rank

FP32 = 4


@dataclass(frozen=True)
class Phase:
    name: str
    activations: int  # saved tensors of the micro-batches in flight at that moment
    transients: dict[str, int] = field(default_factory=dict)  # name -> bytes allocated beside them

    @property
    def total(self) -> int:
        return self.activations + sum(self.transients.values())


def loads_batches(cfg: RunConfig, pp_rank: int, tp_rank: int) -> bool:
    """Whether this rank draws its batches from the data iterator: Megatron-LM's get_batch on TP rank 0 of the first
    and last stages (the other TP ranks receive a broadcast copy)."""
    return tp_rank == 0 and pp_rank in (0, cfg.parallel.pipeline_model_parallel_size - 1)


def kept_batches(cfg: RunConfig, pp_rank: int, tp_rank: int) -> bool:
    """Whether the rank's iteration batches stay live until the next iteration (RerunDataIterator)."""
    return cfg.implementation.keeps_iteration_batches and loads_batches(cfg, pp_rank, tp_rank)


def kept_batch_bytes(cfg: RunConfig, pp_rank: int, tp_rank: int) -> int:
    """Every micro-batch's device batch of an iteration where the rerun data iterator keeps them: tokens, labels and
    position ids (int64), the loss mask (fp32) and the dataloader's [b, 1, s, s] boolean mask, whole-sequence (a
    context-parallel rank slices a copy)."""
    if not kept_batches(cfg, pp_rank, tp_rank):
        return 0
    b, s = cfg.train.micro_batch_size, cfg.model.seq_length
    return cfg.num_microbatches * (b * s * (3 * 8 + FP32) + core_attention.mask_bytes(cfg))


def stage_phases(cfg: RunConfig, pp_rank: int, tp_rank: int = 0) -> list[Phase]:
    """The stage's phases on TP rank `tp_rank`; where its batches are kept for the iteration, the masks and token ids
    of the micro-batches in flight are among them (peak_memory.persistent_bytes) and not counted here again."""
    if not cfg.implementation.megatron:
        saved = activations.stage_activation_bytes(cfg, pp_rank)
        return [Phase("saved activations at the schedule's peak", saved), *output_backward(cfg, pp_rank),
                *grouped_fc1_backward(cfg, pp_rank), *delayed_wgrad_phases(cfg, pp_rank, saved)]
    kept = kept_batches(cfg, pp_rank, tp_rank)
    phases = [Phase("backward of the oldest micro-batch",
                    activations.stage_activation_bytes(cfg, pp_rank) - (_in_batches(cfg, pp_rank) if kept else 0))]
    if pp_rank == cfg.parallel.pipeline_model_parallel_size - 1:
        phases.append(loss_forward(cfg, pp_rank, kept))
    if cfg.implementation.unfused_attention and stage_num_layers(cfg.parallel, cfg.model.num_layers, pp_rank):
        phases += [attention_forward(cfg, pp_rank, kept), attention_backward(cfg, pp_rank, kept)]
    phases.append(optimizer_step(cfg, pp_rank))
    return phases


def output_backward(cfg: RunConfig, pp_rank: int, held: int = 0, label: str = "") -> list[Phase]:
    """This engine's last stage as its backward starts, with `held` bytes more than a forward's end (the delayed
    expert operands); none on other stages. Unfused, the loss's backward holds its gradient beside the logits it
    saved; then the output layer's, the loss's tensors freed, holds that gradient beside the output weight's
    gradient (DDP's placeholder where the wgrad GEMM added into main_grad, else the 16-bit dL/dW) and the layer's
    input gradient. Fused (--cross-entropy-fusion-impl linear), one backward holds the input gradient throughout, a
    16-bit dL/dW too where it is not added into main_grad, and the placeholder once its chunks are done."""
    if pp_rank != cfg.parallel.pipeline_model_parallel_size - 1:
        return []
    end = activations.end_of_forward_bytes(cfg, pp_rank) + held
    weight_grad = {"output weight's gradient": activations.output_weight_bytes(cfg)}
    input_grad = {"output layer's input gradient": activations.output_input_grad_bytes(cfg)}
    if cfg.model.linear_cross_entropy:
        during = {**input_grad, **({} if cfg.implementation.gradient_accumulation_fusion else weight_grad)}
        return [Phase(f"{label}fused output layer and loss backward", end, during),
                Phase(f"{label}fused output layer and loss backward, its chunks done",
                      end - activations.loss_chunk_bytes(cfg), {**input_grad, **weight_grad})]
    grad = {"the loss's gradient (logits)": activations.logits_transient_bytes(cfg)}
    return [Phase(f"{label}loss backward", end, grad),
            Phase(f"{label}output layer backward", end - activations.loss_saved_bytes(cfg),
                  {**grad, **weight_grad, **input_grad})]


def grouped_fc1_backward(cfg: RunConfig, pp_rank: int, held: int = 0, label: str = "") -> list[Phase]:
    """--moe-grouped-gemm: the chunk's last layer in backward as its experts' fc1 returns, `held` bytes more than a
    forward's end (the delayed expert operands). One backward returns every local expert's weight gradient at once
    (grouped_gemm_util._GroupedLinear: DDP's placeholder each, E [2f/t, h] tensors), beside fc1's output gradient
    (SwiGLU's backward), its input gradient and the residual stream's. Freed by then: the last stage's extras (the
    loss, the output layer's input, the final norm's), and this layer's combine rows, SwiGLU input and (unless its
    operands are held for the flush, with its output gradient) fc2's input. None without grouped experts, and none
    where full recompute rebuilds that layer in its backward (not modelled: no real run of it)."""
    x = ExpertShapes.of(cfg)
    start = activations.held_chunks(cfg, pp_rank).backward_start
    if x is None or not x.grouped or start is None:
        return []
    m, a, rows = cfg.model, activations.activation_bytes(cfg), x.grouped_rows
    saved = activations.moe_saved_tensors(cfg)
    delayed = bool(activations.delayed_wgrad_bytes(cfg))
    freed = (saved["combine.expert_rows=experts.output"] + saved["experts.swiglu.input=linear_fc1.output"]
             + (0 if delayed else saved["experts.linear_fc2.input"]))
    before = start + activations.first_stage_bytes(cfg, pp_rank) + activations.mask_bytes_in_flight(cfg, pp_rank)
    grads = {"fc1's output gradient": a * rows * x.fc1, "fc1's input gradient": a * rows * m.hidden_size,
             "every local expert's fc1 weight gradient": x.local_experts * a * x.fc1 * m.hidden_size,
             "residual stream gradient": activations.layer_input_bytes(cfg),
             **({"fc2's output gradient (held for the flush)": a * rows * m.hidden_size} if delayed else {})}
    return [Phase(f"{label}grouped expert fc1 backward (the chunk's last layer)", before - freed + held, grads)]


def delayed_wgrad_phases(cfg: RunConfig, pp_rank: int, saved: int) -> list[Phase]:
    """The two moments --moe-delay-expert-wgrad adds (module docstring); none without it. The operands held are
    counted in layers: every backward's before the stage's last forward (walked: chunks may differ), then all of the
    step's at the flush."""
    per_layer = activations.delayed_wgrad_bytes(cfg)
    if not per_layer:
        return []
    held = activations.layers_backward_before_last_forward(cfg, pp_rank) * per_layer
    total = cfg.num_microbatches * stage_num_layers(cfg.parallel, cfg.model.num_layers, pp_rank) * per_layer
    return [Phase("last steady backward, the earlier backwards' expert operands held", saved + held),
            *output_backward(cfg, pp_rank, held, "last steady backward's "),
            *grouped_fc1_backward(cfg, pp_rank, held, "last steady backward's "),
            Phase("delayed expert wgrads", total,
                  {"one weight's operands concatenated": activations.delayed_wgrad_flush_bytes(cfg)})]


def peak_phase(cfg: RunConfig, pp_rank: int, tp_rank: int = 0) -> Phase:
    return max(stage_phases(cfg, pp_rank, tp_rank), key=lambda p: p.total)


def _in_batches(cfg: RunConfig, pp_rank: int) -> int:
    """What activations.py counts of the micro-batches in flight that is their batches' own tensors: the masks the
    layers keep and the embedding's saved token ids (a kept batch holds them already)."""
    return activations.mask_bytes_in_flight(cfg, pp_rank) + activations.first_stage_bytes(cfg, pp_rank)


def _unkept_mask(cfg: RunConfig, kept: bool) -> dict[str, int]:
    """The running micro-batch's dataloader mask where no layer keeps it (it is alive through its forward) and no
    kept batch holds it."""
    if core_attention.keeps_mask(cfg) or not cfg.implementation.create_attention_mask or kept:
        return {}
    return {"attention mask (the running micro-batch's)": core_attention.mask_bytes(cfg)}


def loss_forward(cfg: RunConfig, pp_rank: int, kept: bool) -> Phase:
    tokens = local_seq_length(cfg) * cfg.train.micro_batch_size
    logits = DTYPE_BYTES[cfg.train.params_dtype] * tokens * vocab_shard(cfg)
    saved = activations.end_of_forward_bytes(cfg, pp_rank) - (_in_batches(cfg, pp_rank) if kept else 0)
    return Phase("loss forward", saved,
                 {"output_layer.logits (16-bit, beside the loss's fp32 copy)": logits, **_unkept_mask(cfg, kept)})


def _before_last_layer(cfg: RunConfig, pp_rank: int, kept: bool) -> int:
    """What the stage keeps when its running micro-batch reaches its chunk's last layer: the other micro-batches in
    flight, the stage's extras and this micro-batch's earlier layers."""
    earlier = activations.held_chunks(cfg, pp_rank).at_last_layer
    return earlier + (0 if kept else _in_batches(cfg, pp_rank))  # a kept batch holds them


def _qkv_output(cfg: RunConfig) -> dict[str, int]:
    """The QKV projection's output, referenced by the caller's q / k / v views until core attention returns,
    where no saved view keeps it already."""
    before = megatron_layer.before_core(cfg)
    if any(name.startswith("linear_qkv.output") for name in before):
        return {}
    m, t = cfg.model, cfg.parallel.tensor_model_parallel_size
    qkv = (m.num_attention_heads + 2 * m.num_query_groups) * m.head_dim // t
    tokens = local_seq_length(cfg) * cfg.train.micro_batch_size
    return {"linear_qkv.output (the caller's views)": DTYPE_BYTES[cfg.train.params_dtype] * tokens * qkv}


def attention_forward(cfg: RunConfig, pp_rank: int, kept: bool) -> Phase:
    layer = sum(megatron_layer.before_core(cfg).values()) + sum(core_attention.saved_tensors(cfg).values())
    return Phase("core attention forward (last layer)", _before_last_layer(cfg, pp_rank, kept) + layer,
                 {"attention scores (held until DotProductAttention returns)": core_attention.forward_transient(cfg),
                  **_qkv_output(cfg), **_unkept_mask(cfg, kept)})


def attention_backward(cfg: RunConfig, pp_rank: int, kept: bool) -> Phase:
    """Core attention's inputs stay (baddbmm's q and repeated k are used last); the repeated v went with bmm's
    backward; beside the score-sized gradients, the residual stream's gradient and v's."""
    m, t = cfg.model, cfg.parallel.tensor_model_parallel_size
    a, tokens = DTYPE_BYTES[cfg.train.params_dtype], local_seq_length(cfg) * cfg.train.micro_batch_size
    sp = t if cfg.parallel.sequence_parallel else 1
    inputs = {k: v for k, v in megatron_layer.before_core(cfg).items()
              if not k.startswith(("attention.v", "linear_qkv.output"))}
    grads = {"residual gradient": a * tokens * m.hidden_size // sp,
             "v gradient": a * tokens * m.num_attention_heads * m.head_dim // t}
    scores = core_attention.backward_transient(cfg)
    return Phase("core attention backward (last layer)", _before_last_layer(cfg, pp_rank, kept) + sum(inputs.values()),
                 {"score gradients (AsStrided / CopySlices / masked_fill copies)": scores, **grads})


def optimizer_step(cfg: RunConfig, pp_rank: int) -> Phase:
    if cfg.implementation.optimizer_impl != FOREACH_ADAM:
        return Phase("optimizer step", 0)
    return Phase("optimizer step", 0, {"AdamW foreach temporary (sqrt of exp_avg_sq)":
                                       FP32 * max(owned_per_dp_rank(cfg, pp_rank))})
