"""The run configuration schema: dataclasses, presets and their validation, torch-free.

The resolved config is written into the run directory's manifest (`RunConfig.to_dict`) and read back from it
(`RunConfig.from_dict`); that dict is the contract between the engine and the ledger, not this module's objects.
Command-line flags become a RunConfig in common.arguments (Megatron's arguments.py); `validate` holds every check
Megatron's validate_args makes for the features we have, so a config built any other way is checked the same.
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.data_flags import parse_blend, parse_split
from common.errors import ConfigError


@dataclass
class ModelConfig:
    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    vocab_size: int
    seq_length: int
    max_position_embeddings: int
    rotary_base: float = 10000.0
    norm_epsilon: float = 1e-5
    make_vocab_size_divisible_by: int = 128
    init_method_std: float = 0.02
    # Megatron ties the output layer to the input embedding unless --untie-embeddings-and-output-weights.
    untie_embeddings_and_output_weights: bool = False
    # The layer's flavour, Megatron's TransformerConfig. Defaults: the Llama-style model the engine implements (and
    # every manifest written before these fields existed): SwiGLU MLP (--swiglu: fc1 is 2f x h, gate and up), no
    # biases (--disable-bias-linear), RMSNorm, RoPE. A GPT-style model (Megatron's defaults without those flags:
    # fc1 f x h with GeLU, biases, LayerNorm with a bias, learned absolute position embeddings) is for the ledger's
    # formulas only (simulate / search); the engine refuses it.
    swiglu: bool = True
    add_bias_linear: bool = False
    normalization: str = "RMSNorm"  # or "LayerNorm" (a weight and a bias)
    position_embedding_type: str = "rope"  # or "learned_absolute" (a max_position_embeddings x h table)
    # Mixture of experts, Megatron's --num-experts and --moe-* flags (docs/engine.md, "Mixture of experts"). None is
    # the dense model; with experts every layer's MLP is an MoE layer (Megatron's default --moe-layer-freq 1): a
    # router (h -> E logits, top-k, softmax over the k chosen) and E SwiGLU experts of width moe_ffn_hidden_size.
    num_experts: int | None = None
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int | None = None  # each expert's f; None: --ffn-hidden-size, as Megatron
    moe_aux_loss_coeff: float = 0.0  # the load-balancing loss's weight (Switch Transformer's alpha)
    moe_expert_capacity_factor: float | None = None  # None: no capacity, no token dropped
    # Megatron's --moe-grouped-gemm: the rank's experts run as one grouped GEMM per linear over rows grouped by expert,
    # with the per-expert row counts left on the device (docs/engine.md, "Mixture of experts"); without it each
    # expert's MLP runs on its own rows (SequentialMLP), whose sizes the host reads every layer.
    moe_grouped_gemm: bool = False
    # Megatron's --cross-entropy-loss-fusion and --cross-entropy-fusion-impl. The engine's loss is always its fused
    # vocab-parallel cross entropy over the output layer's whole [s, b, V/t] logits ("native"); "linear" (with the
    # fusion on) fuses the output layer into the loss over chunks of tokens, so no [s, b, V/t] tensor is ever held,
    # at the price of the output layer's forward GEMM again in backward (docs/engine.md, "Output layer and loss").
    cross_entropy_loss_fusion: bool = False
    cross_entropy_fusion_impl: str = "native"

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def expert_ffn_hidden_size(self) -> int:
        return self.moe_ffn_hidden_size if self.moe_ffn_hidden_size is not None else self.ffn_hidden_size

    @property
    def linear_cross_entropy(self) -> bool:
        """The output layer and the loss fused over chunks of tokens (--cross-entropy-fusion-impl linear)."""
        return self.cross_entropy_loss_fusion and self.cross_entropy_fusion_impl == "linear"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        """Width of the K (or V) projection: query groups x head dim (GQA)."""
        return self.num_query_groups * self.head_dim

    @property
    def layer_norm(self) -> bool:
        """LayerNorm (a bias beside the weight, and a mean saved per token) rather than RMSNorm."""
        return self.normalization == "LayerNorm"

    @property
    def learned_positions(self) -> bool:
        return self.position_embedding_type == "learned_absolute"

    @property
    def llama_style(self) -> bool:
        """The one flavour the engine implements (see the fields above)."""
        return (self.swiglu and not self.add_bias_linear and self.normalization == "RMSNorm"
                and self.position_embedding_type == "rope")


@dataclass
class ParallelConfig:
    world_size: int = 1
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    # Experts are laid out on a grid of their own (Megatron's expert rank generator): tp x ep x expert-dp x pp, where
    # expert-dp = world / (tp x ep x pp) (the expert tensor-parallel size is tp, Megatron's default).
    expert_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    sequence_parallel: bool = False
    order: str = "tp-cp-ep-dp-pp"
    # Not a flag: what the engine that wrote a manifest did. Today's builds an NCCL communicator only for a process
    # group of more than one rank; manifests from before this field were written by an engine that built one for
    # every group, one rank or more (from_dict), which the ledger's device-memory formula counts.
    communicators_for_groups_of_one: bool = False

    @property
    def data_parallel_size(self) -> int:
        model_parallel = (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                          * self.context_parallel_size)
        return self.world_size // model_parallel if model_parallel > 0 else 0  # sizes < 1: validate refuses them

    @property
    def expert_data_parallel_size(self) -> int:
        """The ranks holding the same experts, over which expert gradients are reduced (Megatron's expt_dp)."""
        expert_parallel = (self.tensor_model_parallel_size * self.expert_model_parallel_size
                           * self.pipeline_model_parallel_size)
        return self.world_size // expert_parallel if expert_parallel > 0 else 0


@dataclass
class TrainConfig:
    micro_batch_size: int = 1
    global_batch_size: int | None = None
    train_iters: int = 10
    lr: float = 3e-4
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_style: str = "cosine"
    lr_decay_iters: int | None = None
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    bf16: bool = False
    fp16: bool = False
    use_distributed_optimizer: bool = False
    overlap_grad_reduce: bool = False
    overlap_param_gather: bool = False
    ddp_bucket_size: int | None = None
    grad_reduce_in_bf16: bool = False
    seed: int = 1234
    mock_data: bool = True
    data_path: list[str] | None = None  # Megatron's --data-path: PREFIX, or a blend WEIGHT PREFIX WEIGHT PREFIX ...
    split: str = "969,30,1"  # Megatron's default --split (train,valid,test over the documents)
    data_cache_path: str | None = None  # Megatron's --data-cache-path; None: PREFIX/cache/ (engine.datasets.cache)
    log_interval: int = 1
    # Megatron's --deterministic-mode: deterministic kernels only (torch.use_deterministic_algorithms, a fixed cuBLAS
    # workspace), so that two runs of the same flags, and a run resumed from a checkpoint, give the same bits on GPU.
    deterministic_mode: bool = False

    @property
    def params_dtype(self) -> str:
        return "bf16" if self.bf16 else "fp16" if self.fp16 else "fp32"

    @property
    def grad_dtype(self) -> str:
        """Megatron accumulates and reduces grads in fp32 under --bf16 unless --grad-reduce-in-bf16."""
        if self.params_dtype == "fp32":
            return "fp32"
        return "bf16" if self.grad_reduce_in_bf16 else "fp32"


@dataclass
class ProbeConfig:
    run_dir: str | None = None
    tensorboard_dir: str | None = None
    log_memory_to_tensorboard: bool = False
    use_pytorch_profiler: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    nsys_profile: bool = False
    record_memory_history: bool = False
    nvml_interval: float = 0.0
    nvtx: bool = False
    timers: bool = False
    bandwidth_sweep: bool = False
    compute_sweep: bool = False
    compute_sweep_cache: bool = True  # reuse this machine's cached sweep of the same shapes


@dataclass
class RecomputeConfig:
    """Activation recompute, Megatron's TransformerConfig fields. granularity None | "full" (whole layers, cut per
    model chunk by method "uniform": groups of num_layers, or "block": the first num_layers one by one) |
    "selective" (core attention only). Rules: validate; what each saves: docs/formulas.md ("Recompute")."""
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None


@dataclass
class CheckpointConfig:
    """Megatron's checkpoint flags (engine/checkpointing.py; docs/engine.md, "Checkpoints"): where to save and how
    often, where to resume from and what to take from it, and when to stop early (as a preempted job does)."""
    save: str | None = None
    save_interval: int | None = None
    load: str | None = None
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None  # stop (saving first) once training has run this long
    async_save: bool = False  # write in a background thread after a blocking copy to host memory
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False


@dataclass
class RunConfig:
    model: ModelConfig
    parallel: ParallelConfig
    train: TrainConfig
    probes: ProbeConfig
    model_preset: str | None = None
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

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
        return cls(model=ModelConfig(**model), parallel=ParallelConfig(**parallel),
                   train=TrainConfig(**d["train"]), probes=ProbeConfig(**d["probes"]),
                   model_preset=d.get("model_preset"),
                   recompute=RecomputeConfig(**d.get("recompute", {})),  # manifests before recompute lack it
                   checkpoint=CheckpointConfig(**d.get("checkpoint", {})))  # nor before checkpoints


# Shapes only; tying is --untie-embeddings-and-output-weights (tied without it, as Megatron). The seeds' shape is
# llama3.2-1b (L16 h2048 f8192 32/8 heads vocab 128256): 1,235,814,400 parameters tied, as the real Llama-3.2-1B,
# 1,498,482,688 untied, as the seeds' scripts run it. The real Llama-3.1-8B is untied: pass the flag.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(num_layers=4, hidden_size=64, ffn_hidden_size=176, num_attention_heads=8, num_query_groups=4,
                 vocab_size=1000, seq_length=32, max_position_embeddings=32, rotary_base=10000.0,
                 make_vocab_size_divisible_by=8),
    "llama3.2-1b": dict(num_layers=16, hidden_size=2048, ffn_hidden_size=8192, num_attention_heads=32,
                        num_query_groups=8, vocab_size=128256, seq_length=4096, max_position_embeddings=131072,
                        rotary_base=500000.0),
    "llama3.1-8b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                        num_query_groups=8, vocab_size=128256, seq_length=8192, max_position_embeddings=131072,
                        rotary_base=500000.0),
    "llama3.1-70b": dict(num_layers=80, hidden_size=8192, ffn_hidden_size=28672, num_attention_heads=64,
                         num_query_groups=8, vocab_size=128256, seq_length=8192, max_position_embeddings=131072,
                         rotary_base=500000.0),
    # GPT-3 175B (Brown et al. 2020) as Megatron-LM trains it: Megatron's defaults without --swiglu,
    # --disable-bias-linear, --normalization RMSNorm or --position-embedding-type rope (GeLU MLP of 4h, biases,
    # LayerNorm, learned positions), the GPT-2 BPE vocabulary: 174,604,836,864 parameters at tp 1 (~174.6B).
    # For the ledger's formulas (simulate / search); the engine implements the Llama style only.
    "gpt3-175b": dict(num_layers=96, hidden_size=12288, ffn_hidden_size=49152, num_attention_heads=96,
                      num_query_groups=96, vocab_size=50257, seq_length=2048, max_position_embeddings=2048,
                      swiglu=False, add_bias_linear=True, normalization="LayerNorm",
                      position_embedding_type="learned_absolute"),
    # Mixtral 8x7B (Jiang et al. 2024; the public config.json): Llama-style layers whose MLP is 8 SwiGLU experts of
    # f 14336, each token routed to 2, untied output layer: 46,702,792,704 parameters (docs/formulas.md, "Mixture of
    # experts"). The "-2l" cut keeps its shape at 2 layers (3.16 B parameters, ~57 GB of bf16 Adam state on one rank),
    # so that one H200 trains it.
    "mixtral-8x7b": dict(num_layers=32, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                         num_query_groups=8, vocab_size=32000, seq_length=4096, max_position_embeddings=32768,
                         rotary_base=1000000.0, num_experts=8, moe_router_topk=2,
                         untie_embeddings_and_output_weights=True),
    "mixtral-8x7b-2l": dict(num_layers=2, hidden_size=4096, ffn_hidden_size=14336, num_attention_heads=32,
                            num_query_groups=8, vocab_size=32000, seq_length=4096, max_position_embeddings=32768,
                            rotary_base=1000000.0, num_experts=8, moe_router_topk=2,
                            untie_embeddings_and_output_weights=True),
}

# Sizes far beyond any real run are refused rather than computed: the formulas enumerate layers and ranks, so a typo
# such as --num-layers 100000000 would otherwise run for minutes. The largest public runs are far inside these.
MAX_WORLD_SIZE = 65_536
MAX_LAYERS = 10_000
MAX_WIDTH = 1 << 20  # hidden, ffn, heads, query groups
MAX_TOKENS = 1 << 27  # sequence length, max position embeddings, vocabulary (128 Mi)


def check_ranges(cfg: RunConfig) -> None:
    """Every number in range, one message naming the flag: counts >= 1 (and below the bounds above), rates and
    coefficients finite and >= 0, Adam's betas in [0, 1), epsilons > 0."""
    m, p, t, pr = cfg.model, cfg.parallel, cfg.train, cfg.probes
    counts = [("--num-layers", m.num_layers, MAX_LAYERS), ("--hidden-size", m.hidden_size, MAX_WIDTH),
              ("--ffn-hidden-size", m.ffn_hidden_size, MAX_WIDTH),
              ("--num-attention-heads", m.num_attention_heads, MAX_WIDTH),
              ("--num-query-groups", m.num_query_groups, MAX_WIDTH), ("--vocab-size", m.vocab_size, MAX_TOKENS),
              ("--seq-length", m.seq_length, MAX_TOKENS),
              ("--max-position-embeddings", m.max_position_embeddings, MAX_TOKENS),
              ("--make-vocab-size-divisible-by", m.make_vocab_size_divisible_by, MAX_TOKENS),
              ("world size", p.world_size, MAX_WORLD_SIZE),
              ("--tensor-model-parallel-size", p.tensor_model_parallel_size, MAX_WORLD_SIZE),
              ("--pipeline-model-parallel-size", p.pipeline_model_parallel_size, MAX_WORLD_SIZE),
              ("--context-parallel-size", p.context_parallel_size, MAX_WORLD_SIZE),
              ("--expert-model-parallel-size", p.expert_model_parallel_size, MAX_WORLD_SIZE),
              ("--num-experts", m.num_experts if m.is_moe else 1, MAX_WIDTH),
              ("--moe-router-topk", m.moe_router_topk, MAX_WIDTH),
              ("--moe-ffn-hidden-size", m.expert_ffn_hidden_size, MAX_WIDTH),
              ("--virtual-pipeline-model-parallel-size", p.virtual_pipeline_model_parallel_size or 1, MAX_LAYERS),
              ("--micro-batch-size", t.micro_batch_size, MAX_TOKENS),
              ("--global-batch-size", t.global_batch_size, None),
              ("--train-iters", t.train_iters, None), ("--log-interval", t.log_interval, None),
              ("--profile-step-start", pr.profile_step_start, None), ("--profile-step-end", pr.profile_step_end, None)]
    for flag, value, highest in counts:
        if value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
        if highest is not None and value > highest:
            raise ConfigError(f"{flag} {value:,} is beyond the largest supported value {highest:,}")
    if t.lr_decay_iters is not None and t.lr_decay_iters < 1:
        raise ConfigError(f"--lr-decay-iters must be >= 1, got {t.lr_decay_iters}")
    if t.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {t.seed}")
    for flag, value in (("--lr", t.lr), ("--min-lr", t.min_lr), ("--lr-warmup-iters", t.lr_warmup_iters),
                        ("--moe-aux-loss-coeff", m.moe_aux_loss_coeff),
                        ("--weight-decay", t.weight_decay), ("--clip-grad", t.clip_grad),
                        ("--init-method-std", m.init_method_std), ("--nvml-interval", pr.nvml_interval)):
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"{flag} must be a finite number >= 0, got {value}")
    for flag, value in (("--adam-eps", t.adam_eps), ("--norm-epsilon", m.norm_epsilon),
                        ("--rotary-base", m.rotary_base)):
        if not math.isfinite(value) or value <= 0:
            raise ConfigError(f"{flag} must be a finite number > 0, got {value}")
    for flag, value in (("--adam-beta1", t.adam_beta1), ("--adam-beta2", t.adam_beta2)):
        if not (math.isfinite(value) and 0 <= value < 1):
            raise ConfigError(f"{flag} must be in [0, 1), got {value}")


def validate(cfg: RunConfig) -> None:
    """Every check Megatron's validate_args makes for the features we have, one clear message each."""
    m, p, t, pr = cfg.model, cfg.parallel, cfg.train, cfg.probes
    check_ranges(cfg)
    cp = p.context_parallel_size
    if cp > 1 and m.seq_length % (2 * cp):  # Megatron's validate_args: 2 cp chunks for causal load balancing
        raise ConfigError(f"--seq-length {m.seq_length} is not divisible by 2 x --context-parallel-size {cp} "
                          "(context parallelism splits the sequence into 2 x cp chunks)")
    model_parallel = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * p.context_parallel_size
    if p.world_size % model_parallel:
        raise ConfigError(f"world size {p.world_size} is not divisible by tp {p.tensor_model_parallel_size} x "
                          f"pp {p.pipeline_model_parallel_size} x cp {p.context_parallel_size} = {model_parallel}")
    tp = p.tensor_model_parallel_size
    if m.hidden_size % m.num_attention_heads:
        raise ConfigError(f"--hidden-size {m.hidden_size} is not divisible by --num-attention-heads "
                          f"{m.num_attention_heads}")
    if m.num_attention_heads % m.num_query_groups:
        raise ConfigError(f"--num-attention-heads {m.num_attention_heads} is not divisible by --num-query-groups "
                          f"{m.num_query_groups}")
    if m.num_attention_heads % tp:
        raise ConfigError(f"--num-attention-heads {m.num_attention_heads} is not divisible by "
                          f"--tensor-model-parallel-size {tp}")
    if m.num_query_groups % tp:
        raise ConfigError(f"--num-query-groups {m.num_query_groups} is not divisible by "
                          f"--tensor-model-parallel-size {tp}")
    if m.ffn_hidden_size % tp:
        raise ConfigError(f"--ffn-hidden-size {m.ffn_hidden_size} is not divisible by "
                          f"--tensor-model-parallel-size {tp}")
    if p.sequence_parallel and m.seq_length % tp:
        raise ConfigError(f"--seq-length {m.seq_length} is not divisible by --tensor-model-parallel-size {tp} "
                          "(needed by --sequence-parallel)")
    if p.sequence_parallel and (m.seq_length // cp) % tp:  # each cp rank's s / cp tokens are split over tp
        raise ConfigError(f"--seq-length {m.seq_length} / --context-parallel-size {cp} is not divisible by "
                          f"--tensor-model-parallel-size {tp} (needed by --sequence-parallel)")
    if p.sequence_parallel and tp == 1:
        p.sequence_parallel = False  # Megatron's validate_args turns it off too: nothing to shard over
    if m.seq_length > m.max_position_embeddings:
        raise ConfigError(f"--seq-length {m.seq_length} exceeds --max-position-embeddings "
                          f"{m.max_position_embeddings}")
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
    if m.num_layers % (pp * vpp):
        raise ConfigError(f"--num-layers {m.num_layers} is not divisible by pipeline size {pp} x virtual size {vpp}"
                          " (uneven stages are not supported)")
    dp = p.data_parallel_size
    if t.global_batch_size % (t.micro_batch_size * dp):
        raise ConfigError(f"--global-batch-size {t.global_batch_size} is not divisible by --micro-batch-size "
                          f"{t.micro_batch_size} x data-parallel size {dp}")
    if vpp > 1 and cfg.num_microbatches % pp:
        raise ConfigError(f"interleaved schedule needs the number of micro-batches ({cfg.num_microbatches}) to "
                          f"be a multiple of the pipeline size {pp}")
    check_moe(cfg)
    check_cross_entropy_fusion(m)
    if t.bf16 and t.fp16:
        raise ConfigError("--bf16 and --fp16 are mutually exclusive")
    if t.fp16:
        raise ConfigError("--fp16 training (loss scaling) is not implemented; use --bf16")
    if t.grad_reduce_in_bf16 and not t.bf16:
        raise ConfigError("--grad-reduce-in-bf16 needs --bf16")
    if t.data_path is not None:
        parse_blend(t.data_path)  # the files themselves are checked by the engine's dataset builder
    parse_split(t.split)
    check_ddp_flags(use_distributed_optimizer=t.use_distributed_optimizer, overlap_grad_reduce=t.overlap_grad_reduce,
                    overlap_param_gather=t.overlap_param_gather, bucket_size=t.ddp_bucket_size)
    check_recompute(cfg.recompute)
    check_checkpoint_flags(cfg.checkpoint, t.train_iters)
    decay_iters = t.lr_decay_iters if t.lr_decay_iters is not None else t.train_iters
    if t.lr_warmup_iters >= decay_iters:
        raise ConfigError(f"--lr-warmup-iters {t.lr_warmup_iters} must be < the decay length {decay_iters} "
                          "(--lr-decay-iters, else --train-iters)")
    if t.min_lr > t.lr:
        raise ConfigError(f"--min-lr {t.min_lr} is above --lr {t.lr}")
    if pr.profile_step_end < pr.profile_step_start:
        raise ConfigError(f"--profile-step-end {pr.profile_step_end} is before --profile-step-start "
                          f"{pr.profile_step_start}")
    bad_ranks = [r for r in pr.profile_ranks if not 0 <= r < p.world_size]
    if bad_ranks:
        raise ConfigError(f"--profile-ranks {bad_ranks[0]} is outside the world of {p.world_size} ranks")


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
        return
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


CROSS_ENTROPY_FUSION_IMPLS = ("native", "linear")
# Tokens per chunk of the fused output layer and loss (--cross-entropy-fusion-impl linear): the chunk's logits, not
# the micro-batch's, are what the loss holds at a time (ledger/models/formulas/activations.py counts one chunk).
LINEAR_CROSS_ENTROPY_CHUNK_TOKENS = 1024


def check_cross_entropy_fusion(m: ModelConfig) -> None:
    """The implementation is one the engine has, and it takes effect only with the fusion on: Megatron ignores
    --cross-entropy-fusion-impl without --cross-entropy-loss-fusion, here that is an error (a flag with no effect)."""
    if m.cross_entropy_fusion_impl not in CROSS_ENTROPY_FUSION_IMPLS:
        raise ConfigError(f"--cross-entropy-fusion-impl {m.cross_entropy_fusion_impl}: expected "
                          f"{' or '.join(CROSS_ENTROPY_FUSION_IMPLS)}")
    if m.cross_entropy_fusion_impl != "native" and not m.cross_entropy_loss_fusion:
        raise ConfigError(f"--cross-entropy-fusion-impl {m.cross_entropy_fusion_impl} needs "
                          "--cross-entropy-loss-fusion")


def check_engine_support(cfg: RunConfig) -> None:
    """What the ledger's formulas model (validate accepts it: plan, simulate, search) but the engine does not build.
    `train` calls this before any rank starts; the model refuses the same (engine.models)."""
    p = cfg.parallel
    if cfg.model.is_moe and (p.tensor_model_parallel_size > 1 or p.context_parallel_size > 1):
        raise ConfigError("--num-experts: this engine's MoE layer runs without tensor or context parallelism "
                          f"(tp {p.tensor_model_parallel_size}, cp {p.context_parallel_size}); plan, simulate and "
                          "search model those layouts")


def check_ddp_flags(*, use_distributed_optimizer: bool, overlap_grad_reduce: bool, overlap_param_gather: bool,
                    bucket_size: int | None) -> None:
    """Megatron's validate_args for the DDP knobs: the all-gather only exists with the distributed optimizer, and its
    overlap rides on the same bucket machinery as the reduce overlap. Shared by the CLI check and the engine's
    DistributedDataParallelConfig, which can also be built directly."""
    if overlap_param_gather and not use_distributed_optimizer:
        raise ConfigError("--overlap-param-gather needs --use-distributed-optimizer")
    if overlap_param_gather and not overlap_grad_reduce:
        raise ConfigError("--overlap-param-gather needs --overlap-grad-reduce")
    if bucket_size is not None and bucket_size < 1:
        raise ConfigError(f"--ddp-bucket-size must be >= 1, got {bucket_size}")


def check_recompute(r: RecomputeConfig) -> None:
    """Megatron's TransformerConfig checks: full needs a method and a layer count, selective takes neither. Megatron
    ignores a method or count given without a granularity; here that is an error, as a flag with no effect would be
    (a script that means to recompute and does not). A count above a model chunk's layers is accepted, as Megatron
    accepts it: uniform then makes the whole chunk one group, block checkpoints every layer."""
    granularity, method, count = r.recompute_granularity, r.recompute_method, r.recompute_num_layers
    if granularity not in (None, "full", "selective"):
        raise ConfigError(f"--recompute-granularity {granularity}: expected full or selective")
    if method not in (None, "uniform", "block"):
        raise ConfigError(f"--recompute-method {method}: expected uniform or block")
    if granularity == "full":
        if method is None:
            raise ConfigError("--recompute-granularity full needs --recompute-method (uniform or block)")
        if count is None:
            raise ConfigError("--recompute-granularity full needs --recompute-num-layers")
        if count < 1:
            raise ConfigError(f"--recompute-num-layers must be >= 1, got {count}")
    elif method is not None or count is not None:
        flag = "--recompute-method" if method is not None else "--recompute-num-layers"
        why = " (selective recomputes core attention in every layer)" if granularity == "selective" else ""
        raise ConfigError(f"{flag} needs --recompute-granularity full{why}")


# The checkpoint directory's contract (engine/checkpointing.py writes it), torch-free so that the launcher can check a
# --load before any rank starts. Megatron's names: DIR/iter_0000005/ per save, and the pointer file written last, so
# a checkpoint is visible only once complete.
LATEST_CHECKPOINT_FILE = "latest_checkpointed_iteration.txt"
CHECKPOINT_LAYOUT_FILE = "layout.json"  # written by rank 0 after every rank's file: its presence marks a whole save
# The model fields that decide the parameters' shapes, hence the per-rank files' contents.
LAYOUT_MODEL_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                       "vocab_size", "make_vocab_size_divisible_by", "untie_embeddings_and_output_weights")


def checkpoint_dir_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def check_checkpoint_flags(c: CheckpointConfig, train_iters: int) -> None:
    """Counts >= 1, a duration a finite number of minutes > 0; a flag that could have no effect is an error rather
    than ignored (an --async-save without --save, an exit after the last iteration, a load option without --load),
    except --save-interval without --save, which Megatron accepts and saves nothing with (the seed's run.sh passes
    --save-interval 1000000 and no --save)."""
    for flag, value in (("--save-interval", c.save_interval), ("--exit-interval", c.exit_interval)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if c.exit_duration_in_mins is not None and not (math.isfinite(c.exit_duration_in_mins)
                                                    and c.exit_duration_in_mins > 0):
        raise ConfigError(f"--exit-duration-in-mins must be a number of minutes > 0, got {c.exit_duration_in_mins}")
    if c.exit_interval is not None and c.exit_interval > train_iters:
        raise ConfigError(f"--exit-interval {c.exit_interval} is beyond --train-iters {train_iters}: it would never "
                          "stop the run")
    for flag, value in (("--no-load-optim", c.no_load_optim), ("--no-load-rng", c.no_load_rng),
                        ("--finetune", c.finetune)):
        if value and c.load is None:
            raise ConfigError(f"{flag} needs --load DIR")
    if c.async_save and c.save is None:
        raise ConfigError("--async-save needs --save DIR")


def checkpoint_layout(cfg: RunConfig) -> dict[str, Any]:
    """What a rank's checkpoint file depends on: the parameters' shapes, how they are split over ranks (tp, pp, vpp,
    dp through the world size), the DDP buffers' layout (dtypes, bucket size, distributed optimizer shards), and the
    batch sizes, which give the saved data position (micro-batches consumed) its meaning."""
    p, t = cfg.parallel, cfg.train
    return {"world_size": p.world_size, "tensor_model_parallel_size": p.tensor_model_parallel_size,
            "pipeline_model_parallel_size": p.pipeline_model_parallel_size,
            "context_parallel_size": p.context_parallel_size,
            "virtual_pipeline_model_parallel_size": p.virtual_pipeline_model_parallel_size,
            "params_dtype": t.params_dtype, "grad_dtype": t.grad_dtype,
            "use_distributed_optimizer": t.use_distributed_optimizer, "overlap_grad_reduce": t.overlap_grad_reduce,
            "ddp_bucket_size": t.ddp_bucket_size, "global_batch_size": t.global_batch_size,
            "micro_batch_size": t.micro_batch_size,
            **{name: getattr(cfg.model, name) for name in LAYOUT_MODEL_FIELDS},
            "num_experts": cfg.model.num_experts,
            "moe_ffn_hidden_size": cfg.model.expert_ffn_hidden_size if cfg.model.is_moe else None,
            "expert_model_parallel_size": p.expert_model_parallel_size}


# Keys added to layout.json after checkpoints were first written, with the value an older checkpoint meant.
LAYOUT_DEFAULTS = {"num_experts": None, "moe_ffn_hidden_size": None, "expert_model_parallel_size": 1}


def layout_differences(cfg: RunConfig, saved: dict[str, Any]) -> list[str]:
    """The checkpoint_layout keys whose saved value differs from this run's (a key an older layout.json lacks
    counts as its LAYOUT_DEFAULTS value): none means this rank's own file loads as it is."""
    return [key for key, value in checkpoint_layout(cfg).items() if saved.get(key, LAYOUT_DEFAULTS.get(key)) != value]


def latest_checkpoint(load_dir: str) -> int | None:
    """The iteration of the newest complete checkpoint in load_dir; None when there is none (no pointer file)."""
    pointer = Path(load_dir) / LATEST_CHECKPOINT_FILE
    if not pointer.is_file():
        return None
    text = pointer.read_text().strip()
    if not text.isdigit():
        raise ConfigError(f"--load {load_dir}: {LATEST_CHECKPOINT_FILE} holds {text!r}, not an iteration")
    iteration = int(text)
    if not (Path(load_dir) / checkpoint_dir_name(iteration) / CHECKPOINT_LAYOUT_FILE).is_file():
        raise ConfigError(f"--load {load_dir}: {LATEST_CHECKPOINT_FILE} names iteration {iteration}, but "
                          f"{checkpoint_dir_name(iteration)}/{CHECKPOINT_LAYOUT_FILE} is missing")
    return iteration


def check_load_layout(cfg: RunConfig) -> None:
    """A checkpoint loads at another parallel layout (engine.checkpoint_reshard rebuilds each parameter's state by
    name and cuts it anew: world size, tp, pp, cp, vpp, ep, DDP buckets, micro-batch size), but only into the same
    model shape (the number of experts included), precision, optimizer and global batch size (the saved state and
    data position mean nothing in another): those are refused up front, the first difference named, rather than
    failing inside the ranks."""
    reshardable = ("world_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                   "context_parallel_size", "virtual_pipeline_model_parallel_size", "overlap_grad_reduce",
                   "ddp_bucket_size", "micro_batch_size", "expert_model_parallel_size")
    load = cfg.checkpoint.load
    iteration = latest_checkpoint(load) if load is not None else None
    if iteration is None:
        return
    name = checkpoint_dir_name(iteration)
    path = Path(load) / name / CHECKPOINT_LAYOUT_FILE
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--load {load}: cannot read {path.name} of {name}: {exc}") from exc
    if not isinstance(saved, dict) or any(key not in saved and key not in LAYOUT_DEFAULTS for key in reshardable):
        raise ConfigError(f"--load {load}: {name}/{path.name} does not record the saving run's parallel layout")
    mine = checkpoint_layout(cfg)
    for key in layout_differences(cfg, saved):
        if key not in reshardable:
            raise ConfigError(f"--load {load}: {name} was saved with {key} {saved.get(key, LAYOUT_DEFAULTS.get(key))}"
                              f", this run has {mine[key]}; a checkpoint reshards to another parallel layout, DDP "
                              "bucket size or micro-batch size, but loads only into the same model shape, precision, "
                              "optimizer and global batch size")

