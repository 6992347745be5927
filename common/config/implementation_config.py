"""How a layer is computed, where that changes memory or time but not the model's math: the transformer
implementation, the core attention's backend and fusions, dropout, the gradient-accumulation fusion, the optimizer's
kernels and the dataloader's attention mask (Megatron-LM's --transformer-impl, --attention-backend, fusion and
optimizer flags). The defaults describe this repository's engine, so every config built without Megatron-LM's
arguments (our runs, `train`, `plan`, `simulate` from flags) means what it meant before the field existed; a
Megatron-LM run's arguments (ledger/evidence/megatron) and `--megatron-args` (cli/args.py) set the
values Megatron-LM ran with. docs/formulas.md, "Megatron-LM's saved set", derives what each value changes.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

from common.errors import ConfigError

ENGINE = "engine"  # this repository's engine (engine/)
LOCAL = "local"  # Megatron-LM's --transformer-impl local (Megatron Core's own modules)
TRANSFORMER_ENGINE = "transformer_engine"  # Megatron-LM's default: Transformer Engine's modules
TRANSFORMER_IMPLS = (ENGINE, LOCAL, TRANSFORMER_ENGINE)
FLASH = "flash"  # a kernel that keeps no [b, heads, s, s] tensor: flash / fused attention, torch's SDPA
# cuDNN's fused attention (Megatron's --attention-backend fused, Transformer Engine's FusedAttention; the engine:
# torch's cuDNN SDPA backend): also no [b, heads, s, s] tensor
FUSED = "fused"
UNFUSED = "unfused"  # Megatron's DotProductAttention: baddbmm, masked softmax, bmm on the full score matrix
ATTENTION_BACKENDS = (FLASH, FUSED, UNFUSED)
ENGINE_ATTENTION_BACKENDS = (FLASH, FUSED)  # what `train --attention-backend` takes
FUSED_ADAM = "fused"  # one kernel per step, no temporary (Apex / Transformer Engine FusedAdam, torch's fused AdamW)
FOREACH_ADAM = "foreach"  # torch.optim.AdamW's foreach kernels: a 4-byte temporary per element of a param group
OPTIMIZER_IMPLS = (FUSED_ADAM, FOREACH_ADAM)
NO_CUDA_GRAPH = "none"
LOCAL_CUDA_GRAPH = "local"  # each transformer layer's forward and backward captured once and replayed
CUDA_GRAPH_IMPLS = (NO_CUDA_GRAPH, LOCAL_CUDA_GRAPH)
# engine/jit.py's switch: its pointwise fusions compiled on CUDA ("1", the default) or run as eager chains ("0")
COMPILE_ENV = "TRAIN_LEDGER_COMPILE"
# Megatron-LM's --fp8-format: e4m3 for every GEMM operand, or hybrid (e4m3 forward, e5m2 for the gradients)
FP8_FORMATS = ("e4m3", "hybrid")
TENSORWISE = "tensorwise"  # one scale per tensor, from its current amax (torchao's dynamic tensorwise)
# Megatron-LM's --fp8-recipe choices; only tensorwise is built (engine/fp8_utils.py says why)
FP8_RECIPES = (TENSORWISE, "delayed", "mxfp8", "blockwise")


@dataclass
class ImplementationConfig:
    transformer_impl: str = ENGINE
    attention_backend: str = FLASH
    # Megatron's fused scale-mask-softmax kernel (Apex's scaled_upper_triang_masked_softmax); off: torch's softmax
    masked_softmax_fusion: bool = False
    attention_softmax_in_fp32: bool = False
    attention_dropout: float = 0.0
    hidden_dropout: float = 0.0
    # the weight gradient accumulated straight into the fp32 main_grad (off: a 16-bit wgrad, then added)
    gradient_accumulation_fusion: bool = True
    # the embedding's lookup adds its rows' gradients into main_grad itself (this engine's; off: the dense [V, h]
    # gradient autograd builds, zeroed, scattered into and added by DDP's hook, as Megatron-LM and engines before it)
    embedding_gradient_accumulation_fusion: bool = True
    bias_swiglu_fusion: bool = True  # SwiGLU as one function that keeps its input only
    apply_rope_fusion: bool = True  # RoPE keeps nothing per call (off: Megatron's unfused cos / sin per q and k)
    create_attention_mask: bool = False  # the dataloader's [b, 1, s, s] boolean mask on the device
    # Megatron-LM's RerunDataIterator (--rerun-mode other than disabled) keeps every micro-batch it yields until the
    # next iteration, so an iteration's device batches stay live through the step and after it
    keeps_iteration_batches: bool = False
    # Megatron-LM's --timing-log-level 2: its forward-compute and backward-compute timers call
    # torch.cuda.synchronize() at every pass's start and end, so no pass overlaps the host's work before the next
    timers_synchronise_passes: bool = False
    optimizer_impl: str = FUSED_ADAM
    cuda_graph_impl: str = NO_CUDA_GRAPH  # Megatron-LM's --cuda-graph-impl (engine/transformer/cuda_graphs.py)
    fp8_format: str | None = None  # Megatron-LM's --fp8-format: the layers' GEMMs in fp8 (engine/fp8_utils.py)
    fp8_recipe: str = TENSORWISE  # Megatron-LM's --fp8-recipe
    # the output layer's GEMMs in fp8 too (this engine's flag; torchtitan's float8 converter includes it when its
    # filter_fqns leaves "output" out); Megatron with Transformer Engine keeps it in 16 bits
    fp8_output_layer: bool = False
    # engine/jit.py's fusions (SwiGLU, RoPE, the cross-entropy passes) compiled by torch.compile on CUDA; False: the
    # run had TRAIN_LEDGER_COMPILE=0 and ran them as eager chains of kernels (more launches, fp32 copies of the loss)
    jit_fuser_compile: bool = True

    @property
    def graphed_layers(self) -> bool:
        """Each transformer layer's passes replayed from a CUDA graph (--cuda-graph-impl local)."""
        return self.cuda_graph_impl == LOCAL_CUDA_GRAPH

    @property
    def fp8(self) -> bool:
        """The transformer layers' linears compute in fp8 (--fp8-format)."""
        return self.fp8_format is not None

    @property
    def megatron(self) -> bool:
        """Megatron-LM's own layers (local or Transformer Engine), not this engine's."""
        return self.transformer_impl != ENGINE

    @property
    def fused_attention(self) -> bool:
        """cuDNN's fused attention kernel (--attention-backend fused)."""
        return self.attention_backend == FUSED

    @property
    def unfused_attention(self) -> bool:
        return self.attention_backend == UNFUSED


def jit_fuser_compile_from_environment() -> bool:
    """Whether this process compiles engine/jit.py's fusions: TRAIN_LEDGER_COMPILE unset or "1" yes, "0" no."""
    value = os.environ.get(COMPILE_ENV, "1")
    if value not in ("0", "1"):
        raise ConfigError(f"{COMPILE_ENV}={value!r}: expected 0 (the fusions eager) or 1 (compiled, the default)")
    return value == "1"


def check_implementation(c: ImplementationConfig) -> None:
    for name, value, choices in (("transformer impl", c.transformer_impl, TRANSFORMER_IMPLS),
                                 ("attention backend", c.attention_backend, ATTENTION_BACKENDS),
                                 ("optimizer implementation", c.optimizer_impl, OPTIMIZER_IMPLS),
                                 ("--cuda-graph-impl", c.cuda_graph_impl, CUDA_GRAPH_IMPLS),
                                 ("--fp8-recipe", c.fp8_recipe, FP8_RECIPES)):
        if value not in choices:
            raise ConfigError(f"{name} {value!r}: expected one of {', '.join(choices)}")
    for flag, p in (("--attention-dropout", c.attention_dropout), ("--hidden-dropout", c.hidden_dropout)):
        if not (math.isfinite(p) and 0.0 <= p < 1.0):
            raise ConfigError(f"{flag} must be in [0, 1), got {p}")
    if c.fp8_format is not None and c.fp8_format not in FP8_FORMATS:
        raise ConfigError(f"--fp8-format {c.fp8_format!r}: expected one of {', '.join(FP8_FORMATS)}")
    if c.transformer_impl == ENGINE and (c.attention_dropout or c.hidden_dropout):
        raise ConfigError("dropout is not implemented by the engine; only 0.0 is accepted")
