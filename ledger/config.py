"""The run configuration: Megatron-LM command-line flags -> dataclasses, torch-free.

One parser serves `train-ledger train`, `python -m engine.train` and `train-ledger plan`, so the engine and the
ledger's formulas read the same resolved shape. The resolved config is written into the run directory's manifest
(`RunConfig.to_dict`) and read back from it (`RunConfig.from_dict`); that dict is the contract between the engine and
the ledger, not this module's objects.

Flags keep Megatron-LM's names so that a Megatron user's script runs with the entry point changed. A flag we do not
know is an error that names it. Flags of Megatron's that only restate what this engine always does (RMSNorm, SwiGLU,
RoPE, no biases, untied embeddings) are accepted and checked: a value we do not implement is an error, never ignored.
"""
from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Sequence

from ledger.errors import ConfigError


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

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_channels(self) -> int:
        """Width of the K (or V) projection: query groups x head dim (GQA)."""
        return self.num_query_groups * self.head_dim


@dataclass
class ParallelConfig:
    world_size: int = 1
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    sequence_parallel: bool = False
    order: str = "tp-cp-ep-dp-pp"

    @property
    def data_parallel_size(self) -> int:
        model_parallel = (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                          * self.context_parallel_size)
        return self.world_size // model_parallel


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
    log_interval: int = 1

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


@dataclass
class RunConfig:
    model: ModelConfig
    parallel: ParallelConfig
    train: TrainConfig
    probes: ProbeConfig
    model_preset: str | None = None

    @property
    def num_microbatches(self) -> int:
        return self.train.global_batch_size // (self.train.micro_batch_size * self.parallel.data_parallel_size)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "RunConfig":
        return cls(model=ModelConfig(**d["model"]), parallel=ParallelConfig(**d["parallel"]),
                   train=TrainConfig(**d["train"]), probes=ProbeConfig(**d["probes"]),
                   model_preset=d.get("model_preset"))


# The seeds' shape is llama3.2-1b: L16 h2048 f8192 32/8 heads vocab 128256, untied -> 1,498,482,688 parameters.
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
}

# Megatron flags that restate what the engine always does: the accepted values, checked.
_FIXED_CHOICES: dict[str, tuple[str, ...]] = {
    "--normalization": ("RMSNorm",),
    "--position-embedding-type": ("rope",),
    "--transformer-impl": ("transformer_engine", "local"),
    "--tokenizer-type": ("NullTokenizer",),
}
_ACCEPTED_SWITCHES = ("--use-mcore-models", "--swiglu", "--disable-bias-linear",
                      "--untie-embeddings-and-output-weights", "--group-query-attention", "--use-flash-attn")
_ZERO_ONLY = ("--attention-dropout", "--hidden-dropout")
_IGNORED_VALUES = ("--split", "--save-interval", "--distributed-timeout-minutes", "--eval-iters", "--eval-interval")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print usage and exit; we want one line and status 2
        raise ConfigError(message)


def build_parser(prog: str = "train-ledger train") -> argparse.ArgumentParser:
    p = _Parser(prog=prog, allow_abbrev=False, add_help=True)
    m = p.add_argument_group("model")
    m.add_argument("--model", choices=sorted(PRESETS), help="a preset shape; explicit shape flags override it")
    for name in ("num-layers", "hidden-size", "ffn-hidden-size", "num-attention-heads", "num-query-groups",
                 "vocab-size", "seq-length", "max-position-embeddings", "make-vocab-size-divisible-by"):
        m.add_argument(f"--{name}", type=int)
    m.add_argument("--rotary-base", type=float)
    m.add_argument("--norm-epsilon", type=float)
    m.add_argument("--init-method-std", type=float)

    par = p.add_argument_group("parallel")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1)
    par.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    par.add_argument("--context-parallel-size", type=int, default=1)
    par.add_argument("--virtual-pipeline-model-parallel-size", type=int)
    par.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    par.add_argument("--sequence-parallel", action="store_true")
    par.add_argument("--world-size", type=int, help="for `plan`; `train` takes it from the launcher")

    t = p.add_argument_group("training")
    for name, typ in (("micro-batch-size", int), ("global-batch-size", int), ("train-iters", int),
                      ("lr", float), ("min-lr", float), ("lr-warmup-iters", int), ("lr-decay-iters", int),
                      ("weight-decay", float), ("adam-beta1", float), ("adam-beta2", float), ("adam-eps", float),
                      ("clip-grad", float), ("ddp-bucket-size", int), ("seed", int), ("log-interval", int)):
        t.add_argument(f"--{name}", type=typ)
    t.add_argument("--lr-decay-style", choices=("cosine", "linear", "constant"))
    for name in ("bf16", "fp16", "use-distributed-optimizer", "overlap-grad-reduce", "overlap-param-gather",
                 "grad-reduce-in-bf16", "mock-data"):
        t.add_argument(f"--{name}", action="store_true")

    pr = p.add_argument_group("probes")
    pr.add_argument("--run-dir")
    pr.add_argument("--tensorboard-dir")
    pr.add_argument("--log-memory-to-tensorboard", action="store_true")
    pr.add_argument("--use-pytorch-profiler", action="store_true")
    pr.add_argument("--profile-step-start", type=int)
    pr.add_argument("--profile-step-end", type=int)
    pr.add_argument("--profile-ranks", type=int, nargs="+")
    pr.add_argument("--nsys-profile", action="store_true")
    pr.add_argument("--record-memory-history", action="store_true")
    pr.add_argument("--nvml-interval", type=float)
    pr.add_argument("--nvtx", action="store_true", help="emit NVTX ranges (and matching record_function names)")
    pr.add_argument("--timers", action="store_true", help="CUDA-event / perf_counter timers per micro-batch")
    pr.add_argument("--bandwidth-sweep", action="store_true")
    pr.add_argument("--all-probes", action="store_true",
                    help="every probe on except the profiler window and memory history")

    acc = p.add_argument_group("accepted Megatron flags (checked, no effect beyond the check)")
    for flag, choices in _FIXED_CHOICES.items():
        acc.add_argument(flag, choices=choices)
    for flag in _ACCEPTED_SWITCHES:
        acc.add_argument(flag, action="store_true")
    for flag in _ZERO_ONLY:
        acc.add_argument(flag, type=float)
    for flag in _IGNORED_VALUES:
        acc.add_argument(flag)
    return p


def parse_args(argv: Sequence[str], *, world_size: int | None = None, prog: str = "train-ledger train") -> RunConfig:
    """Parse Megatron-style flags into a validated RunConfig; raise ConfigError on anything wrong."""
    parser = build_parser(prog)
    ns, unknown = parser.parse_known_args(list(argv))
    if unknown:
        raise ConfigError(f"unsupported flag: {unknown[0]}")
    for flag in _ZERO_ONLY:
        value = getattr(ns, flag.lstrip("-").replace("-", "_"))
        if value not in (None, 0.0):
            raise ConfigError(f"{flag} {value}: dropout is not implemented; only 0.0 is accepted")
    return resolve(ns, world_size=world_size)


def resolve(ns: argparse.Namespace, *, world_size: int | None) -> RunConfig:
    shape: dict[str, Any] = dict(PRESETS[ns.model]) if ns.model else {}
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "vocab_size", "seq_length", "max_position_embeddings", "make_vocab_size_divisible_by",
                "rotary_base", "norm_epsilon", "init_method_std"):
        if getattr(ns, key) is not None:
            shape[key] = getattr(ns, key)
    if ns.model is None and not shape:
        shape = dict(PRESETS["tiny"])
    if "num_query_groups" not in shape and "num_attention_heads" in shape:
        shape["num_query_groups"] = shape["num_attention_heads"]
    if "max_position_embeddings" not in shape and "seq_length" in shape:
        shape["max_position_embeddings"] = shape["seq_length"]
    missing = [k for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size",
                           "seq_length") if k not in shape]
    if missing:
        raise ConfigError(f"model shape incomplete: --{missing[0].replace('_', '-')} is required without --model")
    model = ModelConfig(**shape)

    ws = world_size if world_size is not None else (ns.world_size or 1)
    parallel = ParallelConfig(world_size=ws, tensor_model_parallel_size=ns.tensor_model_parallel_size,
                              pipeline_model_parallel_size=ns.pipeline_model_parallel_size,
                              context_parallel_size=ns.context_parallel_size,
                              virtual_pipeline_model_parallel_size=_virtual_pp(ns, model),
                              sequence_parallel=ns.sequence_parallel)
    train = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        value = getattr(ns, f.name, None)
        if value is not None and value is not False:
            setattr(train, f.name, value)
    if train.global_batch_size is None:
        train.global_batch_size = train.micro_batch_size * parallel.data_parallel_size if ws else 1
    probes = _probe_config(ns)
    cfg = RunConfig(model=model, parallel=parallel, train=train, probes=probes, model_preset=ns.model)
    validate(cfg)
    return cfg


def _virtual_pp(ns: argparse.Namespace, model: ModelConfig) -> int | None:
    vpp = ns.virtual_pipeline_model_parallel_size
    per_stage = ns.num_layers_per_virtual_pipeline_stage
    if per_stage is not None:
        pp = ns.pipeline_model_parallel_size
        if per_stage <= 0 or model.num_layers % (per_stage * pp):
            raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {per_stage}: num layers {model.num_layers}"
                              f" is not divisible by {per_stage} x pipeline size {pp}")
        derived = model.num_layers // (per_stage * pp)
        if vpp is not None and vpp != derived:
            raise ConfigError(f"--virtual-pipeline-model-parallel-size {vpp} contradicts "
                              f"--num-layers-per-virtual-pipeline-stage {per_stage} (gives {derived})")
        vpp = derived
    return vpp if vpp and vpp > 1 else None


def _probe_config(ns: argparse.Namespace) -> ProbeConfig:
    pc = ProbeConfig(run_dir=ns.run_dir, tensorboard_dir=ns.tensorboard_dir,
                     log_memory_to_tensorboard=ns.log_memory_to_tensorboard,
                     use_pytorch_profiler=ns.use_pytorch_profiler, nsys_profile=ns.nsys_profile,
                     record_memory_history=ns.record_memory_history, nvtx=ns.nvtx, timers=ns.timers,
                     bandwidth_sweep=ns.bandwidth_sweep)
    if ns.profile_step_start is not None:
        pc.profile_step_start = ns.profile_step_start
    if ns.profile_step_end is not None:
        pc.profile_step_end = ns.profile_step_end
    if ns.profile_ranks is not None:
        pc.profile_ranks = list(ns.profile_ranks)
    if ns.nvml_interval is not None:
        pc.nvml_interval = ns.nvml_interval
    if ns.all_probes:
        pc.nvtx = pc.timers = pc.bandwidth_sweep = pc.log_memory_to_tensorboard = True
        pc.nvml_interval = pc.nvml_interval or 0.5
    return pc


def validate(cfg: RunConfig) -> None:
    """Every check Megatron's validate_args makes for the features we have, one clear message each."""
    m, p, t, pr = cfg.model, cfg.parallel, cfg.train, cfg.probes
    for name, value in (("--tensor-model-parallel-size", p.tensor_model_parallel_size),
                        ("--pipeline-model-parallel-size", p.pipeline_model_parallel_size),
                        ("--context-parallel-size", p.context_parallel_size), ("world size", p.world_size),
                        ("--micro-batch-size", t.micro_batch_size), ("--num-layers", m.num_layers),
                        ("--train-iters", t.train_iters)):
        if value < 1:
            raise ConfigError(f"{name} must be >= 1, got {value}")
    if p.context_parallel_size != 1:
        raise ConfigError("--context-parallel-size > 1 is not implemented by this engine")
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
    if t.bf16 and t.fp16:
        raise ConfigError("--bf16 and --fp16 are mutually exclusive")
    if t.fp16:
        raise ConfigError("--fp16 training (loss scaling) is not implemented; use --bf16")
    if t.grad_reduce_in_bf16 and not t.bf16:
        raise ConfigError("--grad-reduce-in-bf16 needs --bf16")
    check_ddp_flags(use_distributed_optimizer=t.use_distributed_optimizer, overlap_grad_reduce=t.overlap_grad_reduce,
                    overlap_param_gather=t.overlap_param_gather, bucket_size=t.ddp_bucket_size)
    if t.lr_warmup_iters < 0 or t.lr < 0 or t.min_lr < 0:
        raise ConfigError("--lr, --min-lr and --lr-warmup-iters must be >= 0")
    decay_iters = t.lr_decay_iters if t.lr_decay_iters is not None else t.train_iters
    if t.lr_warmup_iters >= decay_iters:
        raise ConfigError(f"--lr-warmup-iters {t.lr_warmup_iters} must be < the decay length {decay_iters} "
                          "(--lr-decay-iters, else --train-iters)")
    if t.min_lr > t.lr:
        raise ConfigError(f"--min-lr {t.min_lr} is above --lr {t.lr}")
    if pr.profile_step_end < pr.profile_step_start:
        raise ConfigError(f"--profile-step-end {pr.profile_step_end} is before --profile-step-start "
                          f"{pr.profile_step_start}")
    if pr.nvml_interval < 0:
        raise ConfigError(f"--nvml-interval must be >= 0, got {pr.nvml_interval}")
    bad_ranks = [r for r in pr.profile_ranks if not 0 <= r < p.world_size]
    if pr.use_pytorch_profiler and bad_ranks:
        raise ConfigError(f"--profile-ranks {bad_ranks[0]} is outside the world of {p.world_size} ranks")


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
