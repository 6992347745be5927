"""Megatron-LM command-line flags -> a validated RunConfig (Megatron's arguments.py), torch-free.

One parser serves `train-ledger train`, `python -m engine.train` and `train-ledger plan`, so the engine and the
ledger's formulas read the same resolved shape. Flags keep Megatron-LM's names so that a Megatron user's script runs
with the entry point changed. A flag we do not know is an error that names it. Flags of Megatron's that only restate
what this engine always does (RMSNorm, SwiGLU, RoPE, no biases) are accepted and checked: a value
we do not implement is an error, never ignored.

`megatron_model=True` (the parsers of `simulate` and `search`, which only run the ledger's formulas) reads the
layer's flavour with Megatron's own semantics instead: an explicit shape is Megatron's default GPT layer unless
flags say otherwise (no --swiglu: fc1 f x h with GeLU; no --disable-bias-linear: biases; --normalization LayerNorm;
--position-embedding-type learned_absolute; --ffn-hidden-size absent: 4h, or with --swiglu Megatron's
int(8h / 3 / 64) x 64), while a --model preset carries its own flavour, which explicit flags override.
"""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any, Sequence

from common.config import (
    CROSS_ENTROPY_FUSION_IMPLS,
    CUDA_GRAPH_IMPLS,
    ENGINE_ATTENTION_BACKENDS,
    FP8_FORMATS,
    FP8_RECIPES,
    PRESETS,
    CheckpointConfig,
    ImplementationConfig,
    ModelConfig,
    ParallelConfig,
    ProbeConfig,
    RecomputeConfig,
    RunConfig,
    TrainConfig,
    check_load_layout,
    jit_fuser_compile_from_environment,
    validate,
)
from common.config.pipeline_layers import LAYOUT_FLAG, layout_stages
from common.errors import ConfigError

# Megatron flags that restate what the engine always does: the accepted values, checked.
_FIXED_CHOICES: dict[str, tuple[str, ...]] = {
    "--normalization": ("RMSNorm",),
    "--position-embedding-type": ("rope",),
    "--transformer-impl": ("transformer_engine", "local"),
    "--tokenizer-type": ("NullTokenizer",),
    "--moe-router-load-balancing-type": ("aux_loss",),
    "--moe-token-dispatcher-type": ("alltoall",),
    "--moe-token-drop-policy": ("probs",),
}
# Under megatron_model the flavour flags take the values the ledger's formulas model (common.config.ModelConfig).
_MEGATRON_MODEL_CHOICES: dict[str, tuple[str, ...]] = {
    "--normalization": ("LayerNorm", "RMSNorm"),
    "--position-embedding-type": ("learned_absolute", "rope"),
}
_ACCEPTED_SWITCHES = ("--use-mcore-models", "--swiglu", "--disable-bias-linear", "--group-query-attention",
                      "--use-flash-attn")
_ZERO_ONLY = ("--attention-dropout", "--hidden-dropout")
_IGNORED_VALUES = ("--distributed-timeout-minutes", "--eval-iters", "--eval-interval")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print usage and exit; we want one line and status 2
        raise ConfigError(message)


MEGATRON_MODEL_DEFAULTS = ("An explicit shape takes Megatron-LM's defaults: a GeLU MLP of 4h unless --swiglu, linear "
                           "biases unless --disable-bias-linear, LayerNorm, learned absolute positions; a --model "
                           "preset carries its own.")


def build_parser(prog: str = "train-ledger train", *, megatron_model: bool = False) -> argparse.ArgumentParser:
    """megatron_model: the flavour flags accept the GPT style too (module docstring)."""
    p = _Parser(prog=prog, allow_abbrev=False, add_help=True)
    m = p.add_argument_group("model", MEGATRON_MODEL_DEFAULTS if megatron_model else None)
    m.add_argument("--model", choices=sorted(PRESETS), help="a preset shape; explicit shape flags override it")
    for name in ("num-layers", "hidden-size", "ffn-hidden-size", "num-attention-heads", "num-query-groups",
                 "vocab-size", "seq-length", "max-position-embeddings", "make-vocab-size-divisible-by"):
        m.add_argument(f"--{name}", type=int)
    m.add_argument("--rotary-base", type=float)
    m.add_argument("--norm-epsilon", type=float)
    m.add_argument("--init-method-std", type=float)
    m.add_argument("--untie-embeddings-and-output-weights", action="store_true",
                   help="a separate output layer; without it the output layer multiplies by the input embedding "
                        "(a --model preset is tied or not as its published config)")
    moe = p.add_argument_group("mixture of experts", "docs/engine.md, Mixture of experts")
    moe.add_argument("--num-experts", type=int, help="experts per MoE layer (every layer); absent: dense MLP")
    moe.add_argument("--moe-router-topk", type=int, help="experts each token is routed to (default 2)")
    moe.add_argument("--moe-ffn-hidden-size", type=int, help="each expert's MLP width (default --ffn-hidden-size)")
    moe.add_argument("--moe-aux-loss-coeff", type=float, help="weight of the load-balancing loss (default 0)")
    moe.add_argument("--moe-expert-capacity-factor", type=float,
                     help="each expert takes at most factor x tokens x topk / experts tokens; the rest are dropped")
    moe.add_argument("--moe-grouped-gemm", action="store_true",
                     help="each linear of the rank's experts as one grouped GEMM, the row counts kept on the device")
    moe.add_argument("--moe-pad-expert-rows", type=int, metavar="N",
                     help="pad each expert's rows with zero rows to a multiple of N, so its GEMMs see few shapes "
                          "(this engine's flag; SequentialMLP experts only)")
    moe.add_argument("--moe-delay-expert-wgrad", action="store_true",
                     help="each expert's weight gradients computed once a step over all micro-batches' rows, their "
                          "operands held until then (this engine's flag; SequentialMLP experts only)")
    fusion = p.add_argument_group("fusions")
    fusion.add_argument("--cross-entropy-loss-fusion", action="store_true",
                        help="fuse the loss (the engine's vocab-parallel cross entropy is always fused; with "
                             "--cross-entropy-fusion-impl linear the output layer joins it)")
    fusion.add_argument("--cross-entropy-fusion-impl", choices=CROSS_ENTROPY_FUSION_IMPLS,
                        help="native (default): the whole [s, b, V/t] logits, then the loss; linear: the output "
                             "layer and the loss over chunks of tokens, the logits never held whole")
    fusion.add_argument("--cuda-graph-impl", choices=CUDA_GRAPH_IMPLS, default="none",
                        help="local: each transformer layer's forward and backward captured as CUDA graphs once and "
                             "replayed, one launch each (one GPU or data parallelism only; docs/engine.md)")
    fusion.add_argument("--attention-backend", choices=ENGINE_ATTENTION_BACKENDS, default="flash",
                        help="core attention's kernel: flash (torch's pick among its SDPA kernels) or fused (cuDNN's "
                             "fused attention; a GPU only, not under context parallelism)")
    fusion.add_argument("--fp8-format", choices=FP8_FORMATS,
                        help="the transformer layers' linears in fp8 through torchao (e4m3 everywhere, or hybrid: "
                             "e5m2 gradients); the embedding and output layer stay in the run's dtype")
    fusion.add_argument("--fp8-output-layer", action="store_true",
                        help="with --fp8-format: the output layer's GEMMs in fp8 too (not Megatron's: it keeps the "
                             "output layer in 16 bits)")
    fusion.add_argument("--no-embedding-gradient-accumulation-fusion", action="store_false",
                        dest="embedding_gradient_accumulation_fusion",
                        help="the embedding's dense [V, h] gradient, added into main_grad by DDP's hook (Megatron's "
                             "way); by default the lookup adds its rows' gradients into main_grad itself")
    fusion.add_argument("--no-gradient-accumulation-fusion", action="store_false",
                        dest="gradient_accumulation_fusion",
                        help="each linear's weight gradient as a 16-bit GEMM that DDP's hook adds into main_grad "
                             "(Megatron's flag); by default the GEMM accumulates into the fp32 main_grad itself")
    fusion.add_argument("--fp8-recipe", choices=FP8_RECIPES, default="tensorwise",
                        help="scaling: tensorwise (dynamic, from each tensor's current amax) is the one built")

    par = p.add_argument_group("parallel")
    par.add_argument("--tensor-model-parallel-size", type=int, default=1)
    par.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    par.add_argument("--context-parallel-size", type=int, default=1)
    par.add_argument("--expert-model-parallel-size", type=int, default=1)
    par.add_argument("--virtual-pipeline-model-parallel-size", type=int)
    par.add_argument("--num-layers-per-virtual-pipeline-stage", type=int)
    par.add_argument("--decoder-first-pipeline-num-layers", type=int,
                     help="the first pipeline stage's decoder layers; the rest split evenly over the others")
    par.add_argument("--decoder-last-pipeline-num-layers", type=int,
                     help="the last pipeline stage's decoder layers; the rest split evenly over the others")
    par.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                     help="count the embedding as a layer when splitting the layers over the virtual stages")
    par.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                     help="count the output layer and loss as a layer when splitting the layers over the stages")
    par.add_argument("--pipeline-model-parallel-layout", metavar="LAYOUT",
                     help="every virtual stage spelled out, '|' between them: E the embedding, t a decoder layer, L "
                          "the loss, (...)*n and x*n repeat ('Et*3|(tt|)*6,tL'); it sets the virtual size")
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
                 "grad-reduce-in-bf16", "mock-data", "deterministic-mode"):
        t.add_argument(f"--{name}", action="store_true")
    t.add_argument("--recompute-granularity", choices=("full", "selective"))
    t.add_argument("--recompute-method", choices=("uniform", "block"))
    t.add_argument("--recompute-num-layers", type=int)
    t.add_argument("--data-path", nargs="+", help="PREFIX of a Megatron .bin/.idx pair, or a blend: 0.7 A 0.3 B")
    t.add_argument("--split", help="train,valid,test weights over the documents (default 969,30,1)")
    t.add_argument("--data-cache-path", help="directory for the dataset's cached indices and vocabulary scan "
                                             "(default: cache/ in the data's folder)")

    ck = p.add_argument_group("checkpoints", "docs/engine.md, Checkpoints")
    ck.add_argument("--save", help="save checkpoints into DIR (every --save-interval iterations and at the end)")
    ck.add_argument("--save-interval", type=int)
    ck.add_argument("--load", help="resume from DIR's latest checkpoint. DIR must exist (a mistyped path is refused); "
                                   "an existing DIR without a checkpoint, or the --save DIR before its first save, "
                                   "starts from scratch and says so; without --load a run always starts fresh")
    ck.add_argument("--exit-interval", type=int, help="stop after iteration N (a multiple of it), saving first")
    ck.add_argument("--exit-duration-in-mins", type=float,
                    help="stop after the first iteration that ends M minutes or more after start-up, saving first "
                         "(every rank stops at the same iteration)")
    ck.add_argument("--async-save", action="store_true",
                    help="copy the state to host memory, then write it in a background thread while training goes on")
    for name in ("no-load-optim", "no-load-rng", "finetune"):
        ck.add_argument(f"--{name}", action="store_true")

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
    pr.add_argument("--compute-sweep", action="store_true",
                    help="time this run's own kernels at start-up (cached per machine and shape) for the time model")
    pr.add_argument("--no-compute-sweep-cache", dest="compute_sweep_cache", action="store_false",
                    help="measure the compute sweep even when this machine's cache holds its shapes")
    pr.add_argument("--host-sweep", action="store_true",
                    help="time the host's dispatch of each kind of call (eager op, compiled region, module call, "
                         "sync, .item()) at start-up for the time model's host timeline")
    pr.add_argument("--all-probes", action="store_true",
                    help="every probe on except the profiler window and memory history")

    acc = p.add_argument_group("accepted Megatron flags (checked, no effect beyond the check)")
    for flag, choices in _FIXED_CHOICES.items():
        acc.add_argument(flag, choices=_MEGATRON_MODEL_CHOICES.get(flag, choices) if megatron_model else choices)
    for flag in _ACCEPTED_SWITCHES:
        acc.add_argument(flag, action="store_true")
    for flag in _ZERO_ONLY:
        acc.add_argument(flag, type=float)
    for flag in _IGNORED_VALUES:
        acc.add_argument(flag)
    return p


def parse_args(argv: Sequence[str], *, world_size: int | None = None, prog: str = "train-ledger train",
               megatron_model: bool = False) -> RunConfig:
    """Parse Megatron-style flags into a validated RunConfig; raise ConfigError on anything wrong.
    megatron_model: the layer's flavour with Megatron's semantics (module docstring), for simulate / search."""
    parser = build_parser(prog, megatron_model=megatron_model)
    ns, unknown = parser.parse_known_args(list(argv))
    if unknown:
        raise ConfigError(f"unsupported flag: {unknown[0]}")
    for flag in _ZERO_ONLY:
        value = getattr(ns, flag.lstrip("-").replace("-", "_"))
        if value not in (None, 0.0):
            raise ConfigError(f"{flag} {value}: dropout is not implemented; only 0.0 is accepted")
    return resolve(ns, world_size=world_size, megatron_model=megatron_model)


def resolve(ns: argparse.Namespace, *, world_size: int | None, megatron_model: bool = False) -> RunConfig:
    model = _model_config(ns, megatron_model=megatron_model)
    ws = world_size if world_size is not None else (ns.world_size if ns.world_size is not None else 1)
    parallel = ParallelConfig(world_size=ws, tensor_model_parallel_size=ns.tensor_model_parallel_size,
                              pipeline_model_parallel_size=ns.pipeline_model_parallel_size,
                              context_parallel_size=ns.context_parallel_size,
                              expert_model_parallel_size=ns.expert_model_parallel_size,
                              virtual_pipeline_model_parallel_size=_virtual_pp(ns, model),
                              decoder_first_pipeline_num_layers=ns.decoder_first_pipeline_num_layers,
                              decoder_last_pipeline_num_layers=ns.decoder_last_pipeline_num_layers,
                              account_for_embedding_in_pipeline_split=ns.account_for_embedding_in_pipeline_split,
                              account_for_loss_in_pipeline_split=ns.account_for_loss_in_pipeline_split,
                              pipeline_model_parallel_layout=ns.pipeline_model_parallel_layout,
                              sequence_parallel=ns.sequence_parallel)
    train = TrainConfig()
    for f in dataclasses.fields(TrainConfig):
        value = getattr(ns, f.name, None)
        if value is not None and value is not False:
            setattr(train, f.name, value)
    if train.global_batch_size is None:  # a grid wider than the world has no dp: validate names the grid, not this
        train.global_batch_size = train.micro_batch_size * max(parallel.data_parallel_size, 1) if ws else 1
    probes = _probe_config(ns)
    if train.data_path is not None:
        if ns.mock_data:
            raise ConfigError("--mock-data and --data-path are alternatives; give one")
        train.mock_data = False
    recompute = RecomputeConfig(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(RecomputeConfig)})
    checkpoint = CheckpointConfig(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(CheckpointConfig)})
    cfg = RunConfig(model=model, parallel=parallel, train=train, probes=probes, model_preset=ns.model,
                    recompute=recompute, checkpoint=checkpoint,
                    implementation=ImplementationConfig(cuda_graph_impl=ns.cuda_graph_impl, fp8_format=ns.fp8_format,
                                                        fp8_recipe=ns.fp8_recipe,
                                                        fp8_output_layer=ns.fp8_output_layer,
                                                        attention_backend=ns.attention_backend,
                                                        gradient_accumulation_fusion=ns.gradient_accumulation_fusion,
                                                        embedding_gradient_accumulation_fusion=(
                                                            ns.embedding_gradient_accumulation_fusion),
                                                        jit_fuser_compile=jit_fuser_compile_from_environment()))
    validate(cfg)
    check_load_path(cfg.checkpoint.load, cfg.checkpoint.save)
    check_load_layout(cfg)
    return cfg


def _model_config(ns: argparse.Namespace, *, megatron_model: bool) -> ModelConfig:
    """The preset's fields (or tiny's, without --model and shape flags), then each shape flag given over it."""
    shape: dict[str, Any] = dict(PRESETS[ns.model]) if ns.model else {}
    explicit_shape = not ns.model and any(getattr(ns, k) is not None for k in _SHAPE_FLAGS)
    for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "vocab_size", "seq_length", "max_position_embeddings", "make_vocab_size_divisible_by",
                "rotary_base", "norm_epsilon", "init_method_std"):
        if getattr(ns, key) is not None:
            shape[key] = getattr(ns, key)
    if ns.model is None and not shape:
        shape = dict(PRESETS["tiny"])
    _flavour(ns, shape, explicit_shape=explicit_shape, megatron_model=megatron_model)
    if "num_query_groups" not in shape and "num_attention_heads" in shape:
        shape["num_query_groups"] = shape["num_attention_heads"]
    if "max_position_embeddings" not in shape and "seq_length" in shape:
        shape["max_position_embeddings"] = shape["seq_length"]
    missing = [k for k in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "vocab_size",
                           "seq_length") if k not in shape]
    if missing:
        raise ConfigError(f"model shape incomplete: --{missing[0].replace('_', '-')} is required without --model")
    for key in (*_MOE_FLAGS, "cross_entropy_fusion_impl"):
        if getattr(ns, key) is not None:
            shape[key] = getattr(ns, key)
    # A preset is untied where its published config is (Llama 3.1, Mixtral); the flag unties any shape, as
    # Megatron's (there is no flag that ties).
    untie = shape.pop("untie_embeddings_and_output_weights", False) or ns.untie_embeddings_and_output_weights
    return ModelConfig(**shape, untie_embeddings_and_output_weights=untie, moe_grouped_gemm=ns.moe_grouped_gemm,
                       moe_delay_expert_wgrad=ns.moe_delay_expert_wgrad,
                       cross_entropy_loss_fusion=ns.cross_entropy_loss_fusion)


def check_load_path(load: str | None, save: str | None) -> None:
    """--load names a folder that exists: a mistyped path would otherwise start the run from scratch, silently
    losing its progress. The one folder that may not exist yet is --save's own (a job that resumes itself after
    each preemption passes the same DIR to both, and its first start has saved nothing)."""
    if load is None:
        return
    path = Path(load)
    if path.is_dir() or (save is not None and path.resolve() == Path(save).resolve()):
        return
    problem = "is a file, not a checkpoint directory" if path.exists() else "does not exist"
    raise ConfigError(f"--load {load}: {problem}; to start from scratch leave out --load (or name an existing "
                      "directory without a checkpoint)")


# The flavour the engine implements: ModelConfig's defaults.
_LLAMA_STYLE = {f.name: f.default for f in dataclasses.fields(ModelConfig)
                if f.name in ("swiglu", "add_bias_linear", "normalization", "position_embedding_type")}
_MOE_FLAGS = ("num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_aux_loss_coeff",
              "moe_expert_capacity_factor", "moe_pad_expert_rows")
_SHAPE_FLAGS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "vocab_size", "seq_length", "max_position_embeddings")


def _flavour(ns: argparse.Namespace, shape: dict[str, Any], *, explicit_shape: bool, megatron_model: bool) -> None:
    """Set the layer's flavour in `shape` (module docstring). Without megatron_model the flags can only restate the
    Llama style (their choices), and a GPT-style preset is refused: train and plan build what the engine runs."""
    if not megatron_model:
        if any(shape.get(key, default) != default for key, default in _LLAMA_STYLE.items()):
            raise ConfigError(f"--model {ns.model} is a GPT-style model (GeLU MLP, biases, LayerNorm, learned "
                              "positions): the engine builds the Llama style only; use simulate or search for it")
        return
    if explicit_shape:  # Megatron's defaults: what its flags do not turn on or off
        shape.update(swiglu=False, add_bias_linear=True, normalization="LayerNorm",
                     position_embedding_type="learned_absolute")
    if ns.swiglu:
        shape["swiglu"] = True
    if ns.disable_bias_linear:
        shape["add_bias_linear"] = False
    for key in ("normalization", "position_embedding_type"):
        if getattr(ns, key) is not None:
            shape[key] = getattr(ns, key)
    if "ffn_hidden_size" not in shape and "hidden_size" in shape:  # Megatron's validate_args
        h = shape["hidden_size"]
        shape["ffn_hidden_size"] = int(4 * h * 2 / 3 / 64) * 64 if shape.get("swiglu", True) else 4 * h


def _virtual_pp(ns: argparse.Namespace, model: ModelConfig) -> int | None:
    vpp = ns.virtual_pipeline_model_parallel_size
    per_stage = ns.num_layers_per_virtual_pipeline_stage
    for flag, value in (("--virtual-pipeline-model-parallel-size", vpp),
                        ("--num-layers-per-virtual-pipeline-stage", per_stage)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if ns.pipeline_model_parallel_layout is not None:
        return _layout_vpp(ns, vpp)
    if per_stage is not None:
        if (ns.decoder_first_pipeline_num_layers is not None or ns.decoder_last_pipeline_num_layers is not None
                or ns.account_for_embedding_in_pipeline_split or ns.account_for_loss_in_pipeline_split):
            raise ConfigError("--num-layers-per-virtual-pipeline-stage assumes even stages; with uneven ones give "
                              "the virtual size (--virtual-pipeline-model-parallel-size; on a Megatron-LM command "
                              "line --num-virtual-stages-per-pipeline-rank)")
        pp = ns.pipeline_model_parallel_size
        if pp < 1 or model.num_layers % (per_stage * pp):
            raise ConfigError(f"--num-layers-per-virtual-pipeline-stage {per_stage}: num layers {model.num_layers}"
                              f" is not divisible by {per_stage} x pipeline size {pp}")
        derived = model.num_layers // (per_stage * pp)
        if vpp is not None and vpp != derived:
            raise ConfigError(f"--virtual-pipeline-model-parallel-size {vpp} contradicts "
                              f"--num-layers-per-virtual-pipeline-stage {per_stage} (gives {derived})")
        vpp = derived
    return vpp if vpp and vpp > 1 else None


def _layout_vpp(ns: argparse.Namespace, vpp: int | None) -> int | None:
    """The virtual size a spelled-out layout gives: its virtual stages over the pipeline size (Megatron derives it
    so), which an explicit --virtual-pipeline-model-parallel-size must agree with."""
    stages, pp = len(layout_stages(ns.pipeline_model_parallel_layout)), ns.pipeline_model_parallel_size
    if ns.num_layers_per_virtual_pipeline_stage is not None:
        raise ConfigError(f"{LAYOUT_FLAG} and --num-layers-per-virtual-pipeline-stage are alternatives: give one")
    if pp < 1 or stages % pp:
        raise ConfigError(f"{LAYOUT_FLAG} has {stages} virtual stage(s), not a multiple of pipeline size {pp}")
    derived = stages // pp
    if vpp is not None and vpp != derived:
        raise ConfigError(f"--virtual-pipeline-model-parallel-size {vpp} contradicts {LAYOUT_FLAG} ({stages} "
                          f"virtual stages over pipeline size {pp}: {derived})")
    return derived if derived > 1 else None


def _probe_config(ns: argparse.Namespace) -> ProbeConfig:
    pc = ProbeConfig(run_dir=ns.run_dir, tensorboard_dir=ns.tensorboard_dir,
                     log_memory_to_tensorboard=ns.log_memory_to_tensorboard,
                     use_pytorch_profiler=ns.use_pytorch_profiler, nsys_profile=ns.nsys_profile,
                     record_memory_history=ns.record_memory_history, nvtx=ns.nvtx, timers=ns.timers,
                     bandwidth_sweep=ns.bandwidth_sweep, compute_sweep=ns.compute_sweep,
                     compute_sweep_cache=ns.compute_sweep_cache, host_sweep=ns.host_sweep)
    if ns.profile_step_start is not None:
        pc.profile_step_start = ns.profile_step_start
    if ns.profile_step_end is not None:
        pc.profile_step_end = ns.profile_step_end
    if ns.profile_ranks is not None:
        pc.profile_ranks = list(ns.profile_ranks)
    if ns.nvml_interval is not None:
        pc.nvml_interval = ns.nvml_interval
    if ns.all_probes:
        pc.nvtx = pc.timers = pc.bandwidth_sweep = pc.compute_sweep = pc.host_sweep = True
        pc.log_memory_to_tensorboard = True
        pc.nvml_interval = pc.nvml_interval or 0.5
    return pc
