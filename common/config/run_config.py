"""The whole run's configuration: one of each config, the manifest's dict form, and the checks that span configs
(a shape against its layout)."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from common.config.checkpoint_config import CheckpointConfig
from common.config.implementation_config import TENSORWISE, ImplementationConfig
from common.config.model_config import ModelConfig
from common.config.parallel_config import ParallelConfig
from common.config.pipeline_layers import check_pipeline_layers
from common.config.probe_config import ProbeConfig
from common.config.recompute_config import RecomputeConfig
from common.config.train_config import TrainConfig
from common.errors import ConfigError
from common.typecheck import check_fields

MAX_PAD_EXPERT_ROWS = 4096  # a multiple beyond a micro-batch's rows pads every expert to a whole extra micro-batch


@dataclass
class RunConfig:
    model: ModelConfig
    parallel: ParallelConfig
    train: TrainConfig
    probes: ProbeConfig
    model_preset: str | None = None
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    implementation: ImplementationConfig = field(default_factory=ImplementationConfig)

    @property
    def num_microbatches(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.parallel.data_parallel_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        # Manifests written before the flag existed lack it: that engine always untied. Before the layer's flavour
        # fields (swiglu, biases, norm, positions) they lack those too: the dataclass defaults, the Llama style.
        # Before communicators_for_groups_of_one, the engine built a communicator for every group.
        model = {"untie_embeddings_and_output_weights": True, **d["model"]}
        parallel = {"communicators_for_groups_of_one": True, **d["parallel"]}
        cfg = cls(model=ModelConfig(**model), parallel=ParallelConfig(**parallel),
                  train=TrainConfig(**d["train"]), probes=ProbeConfig(**d["probes"]),
                  model_preset=d.get("model_preset"),
                  recompute=RecomputeConfig(**d.get("recompute", {})),  # manifests before recompute lack it
                  checkpoint=CheckpointConfig(**d.get("checkpoint", {})),  # nor before checkpoints
                  # nor before Megatron-LM's; before the embedding's fusion its gradient was dense
                  implementation=ImplementationConfig(**{"embedding_gradient_accumulation_fusion": False,
                                                         **d.get("implementation", {})}))
        for name in ("model", "parallel", "train", "probes", "recompute", "checkpoint", "implementation"):
            check_fields(getattr(cfg, name), name)  # a stored config is JSON: its types are not Python's to trust
        return cfg


def check_context_parallel(cfg: RunConfig) -> None:
    """Megatron's validate_args: 2 cp chunks of the sequence for causal load balancing."""
    m, cp = cfg.model, cfg.parallel.context_parallel_size
    if cp > 1 and m.seq_length % (2 * cp):
        raise ConfigError(f"--seq-length {m.seq_length} is not divisible by 2 x --context-parallel-size {cp} "
                          "(context parallelism splits the sequence into 2 x cp chunks)")
    if cp > 1 and cfg.implementation.fused_attention and not cfg.implementation.megatron:
        raise ConfigError(f"--attention-backend fused: ring attention (--context-parallel-size {cp}) runs its own "
                          "flash blocks; use --attention-backend flash")


def check_tensor_parallel(cfg: RunConfig) -> None:
    """Heads, query groups and the MLP's width split over tp."""
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    if m.num_attention_heads % tp:
        raise ConfigError(f"--num-attention-heads {m.num_attention_heads} is not divisible by "
                          f"--tensor-model-parallel-size {tp}")
    if m.num_query_groups % tp:
        raise ConfigError(f"--num-query-groups {m.num_query_groups} is not divisible by "
                          f"--tensor-model-parallel-size {tp}")
    if m.ffn_hidden_size % tp:
        raise ConfigError(f"--ffn-hidden-size {m.ffn_hidden_size} is not divisible by "
                          f"--tensor-model-parallel-size {tp}")


def check_sequence_parallel(cfg: RunConfig) -> None:
    """Each cp rank's s / cp tokens split over tp; with tp 1 there is nothing to shard over, and Megatron's
    validate_args turns --sequence-parallel off, as this does (the one check that changes the config)."""
    m, p = cfg.model, cfg.parallel
    tp, cp = p.tensor_model_parallel_size, p.context_parallel_size
    if not p.sequence_parallel:
        return
    if m.seq_length % tp:
        raise ConfigError(f"--seq-length {m.seq_length} is not divisible by --tensor-model-parallel-size {tp} "
                          "(needed by --sequence-parallel)")
    if (m.seq_length // cp) % tp:
        raise ConfigError(f"--seq-length {m.seq_length} / --context-parallel-size {cp} is not divisible by "
                          f"--tensor-model-parallel-size {tp} (needed by --sequence-parallel)")
    if tp == 1:
        p.sequence_parallel = False


def check_pipeline(cfg: RunConfig) -> None:
    """Layers that split over the stages (pipeline_layers), and micro-batches that fill the data-parallel replicas
    (and the interleaved schedule's rounds)."""
    p, t = cfg.parallel, cfg.train
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
    check_pipeline_layers(p, cfg.model.num_layers)
    dp = p.data_parallel_size
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size "
                          f"{t.micro_batch_size} x data-parallel size {dp}")
    if vpp > 1 and cfg.num_microbatches % pp:
        raise ConfigError(f"interleaved schedule needs the number of micro-batches ({cfg.num_microbatches}) to "
                          f"be a multiple of the pipeline size {pp}")


def check_moe(cfg: RunConfig) -> None:
    """Megatron's validate_args for the MoE flags."""
    m, p = cfg.model, cfg.parallel
    ep = p.expert_model_parallel_size
    cf = m.moe_expert_capacity_factor
    if cf is not None and not (math.isfinite(cf) and cf > 0):
        raise ConfigError(f"--moe-expert-capacity-factor must be a finite number > 0, got {cf}")
    if not m.is_moe:
        if ep > 1:
            raise ConfigError(f"--expert-model-parallel-size {ep} needs --num-experts")
        if m.moe_grouped_gemm:
            raise ConfigError("--moe-grouped-gemm needs --num-experts")
        if m.moe_pad_expert_rows is not None:
            raise ConfigError("--moe-pad-expert-rows needs --num-experts")
        if m.moe_delay_expert_wgrad:
            raise ConfigError("--moe-delay-expert-wgrad needs --num-experts")
        return
    if m.moe_delay_expert_wgrad:
        check_delayed_expert_wgrad(cfg)
    if m.moe_pad_expert_rows is not None:
        if not 1 <= m.moe_pad_expert_rows <= MAX_PAD_EXPERT_ROWS:
            raise ConfigError(f"--moe-pad-expert-rows must be in [1, {MAX_PAD_EXPERT_ROWS}], got "
                              f"{m.moe_pad_expert_rows}")
        if m.moe_grouped_gemm:
            raise ConfigError("--moe-pad-expert-rows pads SequentialMLP's experts; --moe-grouped-gemm runs one "
                              "GEMM over all rows at a fixed shape and takes no padding")
    if m.moe_router_topk > m.num_experts:
        raise ConfigError(f"--moe-router-topk {m.moe_router_topk} exceeds --num-experts {m.num_experts}")
    if m.num_experts % ep:
        raise ConfigError(f"--num-experts {m.num_experts} is not divisible by --expert-model-parallel-size {ep}")
    expert_parallel = p.tensor_model_parallel_size * ep * p.pipeline_model_parallel_size
    if p.world_size % expert_parallel:
        raise ConfigError(f"world size {p.world_size} is not divisible by tp {p.tensor_model_parallel_size} x "
                          f"ep {ep} x pp {p.pipeline_model_parallel_size} = {expert_parallel} (the expert grid)")
    if m.moe_ffn_hidden_size is not None and m.moe_ffn_hidden_size % p.tensor_model_parallel_size:
        raise ConfigError(f"--moe-ffn-hidden-size {m.moe_ffn_hidden_size} is not divisible by "
                          f"--tensor-model-parallel-size {p.tensor_model_parallel_size}")


def check_delayed_expert_wgrad(cfg: RunConfig) -> None:
    """--moe-delay-expert-wgrad adds the experts' weight gradients after the last backward, before the gradients are
    reduced: an overlapped reduction would send the expert buckets before they hold them, and its one GEMM a weight
    is the fused accumulation."""
    if cfg.train.overlap_grad_reduce:
        raise ConfigError("--moe-delay-expert-wgrad adds the experts' gradients after the last backward: not with "
                          "--overlap-grad-reduce, whose buckets are reduced during it")
    if not cfg.implementation.gradient_accumulation_fusion:
        raise ConfigError("--moe-delay-expert-wgrad accumulates the experts' gradients into main_grad in one GEMM a "
                          "weight: not with --no-gradient-accumulation-fusion")


def check_engine_support(cfg: RunConfig) -> None:
    """What the ledger's formulas model (validate accepts it: plan, simulate, search) but the engine does not build.
    `train` calls this before any rank starts; the model refuses the same (engine.models)."""
    p = cfg.parallel
    if cfg.model.is_moe and (p.tensor_model_parallel_size > 1 or p.context_parallel_size > 1):
        raise ConfigError("--num-experts: this engine's MoE layer runs without tensor or context parallelism "
                          f"(tp {p.tensor_model_parallel_size}, cp {p.context_parallel_size}); plan, simulate and "
                          "search model those layouts")


def check_cuda_graphs(cfg: RunConfig) -> None:
    """--cuda-graph-impl local captures each layer's forward and backward once (engine/transformer/cuda_graphs.py):
    what runs inside a layer must be kernels only, the same each micro-batch, one micro-batch in flight. Collectives
    and probe ranges inside a layer (TP, CP, EP), several micro-batches in flight on a stage (PP), a re-run forward
    (recompute) and DDP's per-module all-gather waits (--overlap-param-gather) are none of those."""
    if not cfg.implementation.graphed_layers:
        return
    p, t = cfg.parallel, cfg.train
    tp, pp, cp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size
    conflicts = [(tp > 1, f"--tensor-model-parallel-size {tp}"), (pp > 1, f"--pipeline-model-parallel-size {pp}"),
                 (cp > 1, f"--context-parallel-size {cp}"),
                 (cfg.model.is_moe, "--num-experts"),
                 (cfg.recompute.recompute_granularity is not None,
                  f"--recompute-granularity {cfg.recompute.recompute_granularity}"),
                 (t.overlap_param_gather, "--overlap-param-gather")]
    named = [flag for conflict, flag in conflicts if conflict]
    if named:
        raise ConfigError(f"--cuda-graph-impl local graphs whole layers of one micro-batch in flight, without "
                          f"collectives inside: not with {named[0]}")


FP8_DIM_MULTIPLE = 16  # cuBLAS's fp8 GEMM (torch._scaled_mm) takes operands whose dimensions are multiples of 16


def check_fp8(cfg: RunConfig) -> None:
    """--fp8-format: the transformer layers' linears through torchao's float8 matmul (engine/fp8_utils.py), each
    GEMM on the rank's local shapes. Refused where a layer's linear is not one plain local GEMM of the layer's input
    (sequence parallelism gathers inside it; MoE experts run grouped or per expert; a graph capture is untested),
    for Megatron's recipes torchao does not implement, and for dimensions the fp8 GEMM cannot take."""
    impl = cfg.implementation
    if impl.fp8_output_layer and not impl.fp8:
        raise ConfigError("--fp8-output-layer needs --fp8-format")
    if not impl.fp8:
        return
    if impl.fp8_recipe != TENSORWISE:
        raise ConfigError(f"--fp8-recipe {impl.fp8_recipe}: only tensorwise is implemented (torchao's dynamic "
                          "scaling; it keeps no amax history, so there is no delayed recipe)")
    p, m = cfg.parallel, cfg.model
    conflicts = [(p.sequence_parallel, "--sequence-parallel"), (m.is_moe, "--num-experts"),
                 (impl.graphed_layers, "--cuda-graph-impl local"),
                 (impl.fp8_output_layer and m.linear_cross_entropy, "--cross-entropy-fusion-impl linear")]
    named = [flag for conflict, flag in conflicts if conflict]
    if named:
        raise ConfigError(f"--fp8-format computes each layer's linears as one local fp8 GEMM: not with {named[0]}")
    tp = p.tensor_model_parallel_size
    dims = {"--hidden-size": m.hidden_size, "--ffn-hidden-size / tp": m.ffn_hidden_size // tp,
            "the QKV width / tp": m.head_dim * (m.num_attention_heads + 2 * m.num_query_groups) // tp,
            "the attention width / tp": m.head_dim * m.num_attention_heads // tp,
            "tokens per micro-batch": m.seq_length // p.context_parallel_size * cfg.train.micro_batch_size,
            # the output layer's rows: a multiple of this on every TP rank, whatever the vocabulary
            **({"--make-vocab-size-divisible-by": m.make_vocab_size_divisible_by} if impl.fp8_output_layer else {})}
    odd = [f"{name} {value}" for name, value in dims.items() if value % FP8_DIM_MULTIPLE]
    if odd:
        raise ConfigError(f"--fp8-format needs GEMM dimensions that are multiples of {FP8_DIM_MULTIPLE}: {odd[0]}")
