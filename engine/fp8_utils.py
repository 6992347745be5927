"""FP8 training (Megatron-LM's --fp8-format / --fp8-recipe) through torchao's float8 linear.

Which GEMMs: the transformer layers' four linears (QKV, attention output, fc1, fc2), as Megatron's fp8 with
Transformer Engine: the embedding and the output layer stay in the run's dtype (torchtitan leaves the output layer
out too, by default); --fp8-output-layer (this engine's flag) adds the output layer. Each GEMM is torchao's
`matmul_with_hp_or_float8_args`, the function inside its `Float8Linear`, with the config and GEMM settings a
`Float8Linear` of that recipe carries: so what runs is torchao's float8 linear, on this engine's weights, without
swapping its modules.

The recipe is tensorwise dynamic scaling: each operand's scale comes from its current amax, so nothing is carried
from step to step (no amax history, no persistent fp8 copy of a weight: each cast lives for its GEMM). hybrid:
e4m3 inputs and weights, e5m2 gradients; e4m3: e4m3 everywhere. Compiled, the matmul saves for backward the 1-byte
cast of its input instead of the input (eager, torchao saves the 16-bit input and weight): docs/formulas.md, "FP8".

On CUDA the matmul is compiled (engine/jit.py): amax, scale and cast fuse into a kernel or two per operand, where
eager PyTorch makes five passes over each. On CPU it runs in torchao's emulation (the casts' rounding, the GEMM in
the input's dtype), which is what the tests run. dL/dW comes back from torchao as a tensor of the weight's dtype, so
gradient-accumulation fusion does not apply to these weights: DDP's hook adds it to main_grad.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch

from common.config import ImplementationConfig
from common.errors import ConfigError
from engine.jit import jit_fuser

# One compiled function serves every fp8 linear, and dynamo keeps an entry per shape (four a layer) and way of calling
# (the step's; the compute sweep's forward alone, backward for the input, for the weight): more than its default 8.
FP8_RECOMPILE_LIMIT = 32


@dataclass(frozen=True)
class Fp8Recipe:
    fp8_format: str  # "e4m3" or "hybrid" (--fp8-format)
    emulate: bool  # torchao's emulation: off the GPU, where there is no fp8 GEMM

    @classmethod
    def from_implementation(cls, impl: ImplementationConfig, device: torch.device) -> Fp8Recipe:
        return cls(fp8_format=impl.fp8_format, emulate=device.type != "cuda")


def _torchao():
    try:
        from torchao.float8 import config, float8_linear
    except ImportError as e:
        raise ConfigError(f"--fp8-format needs torchao (pip install torchao): {e}") from None
    return config, float8_linear


@functools.cache
def fp8_matmul(recipe: Fp8Recipe) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """y = x W^T through torchao's float8 matmul for this recipe; compiled on CUDA (jit_fuser), emulated elsewhere.
    One function per recipe, so each compiles once."""
    config_module, float8_linear = _torchao()
    grad_dtype = torch.float8_e5m2 if recipe.fp8_format == "hybrid" else torch.float8_e4m3fn
    config = config_module.Float8LinearConfig(
        cast_config_grad_output=config_module.CastConfig(target_dtype=grad_dtype), emulate=recipe.emulate)
    with torch.device("meta"):  # torchao's own module, for the GEMM settings it derives from the config
        mm_config = float8_linear.Float8Linear(16, 16, bias=False, config=config).linear_mm_config
    matmul = float8_linear.matmul_with_hp_or_float8_args
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, FP8_RECOMPILE_LIMIT)

    def fp8_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return matmul.apply(x, weight.t(), mm_config, config)

    return jit_fuser(fp8_linear)


LAYER_LINEARS = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")


def layer_linears(module: torch.nn.Module) -> list[torch.nn.Module]:
    """The linears fp8 applies to, in a model chunk or a layer: each transformer layer's QKV, attention output, fc1
    and fc2 (the output layer and the embedding have names of their own)."""
    return [m for name, m in module.named_modules() if name.rsplit(".", 1)[-1] in LAYER_LINEARS]


def convert_to_fp8(chunks: list[torch.nn.Module], impl: ImplementationConfig, device: torch.device) -> int:
    """Set every layer linear of the model chunks (and with --fp8-output-layer the output layer) to compute in fp8,
    as torchao's convert_to_float8_training swaps nn.Linear for Float8Linear; returns how many. The weights stay
    where they are: in DDP's buffers."""
    recipe = Fp8Recipe.from_implementation(impl, device)
    fp8_matmul(recipe)  # torchao is imported now: a missing one is one line before any step
    linears = [linear for chunk in chunks for linear in layer_linears(chunk)]
    if impl.fp8_output_layer:
        linears += [chunk.output_layer for chunk in chunks if getattr(chunk, "output_layer", None) is not None]
    for linear in linears:
        linear.fp8 = recipe
    return len(linears)
