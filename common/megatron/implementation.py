"""The ImplementationConfig of a Megatron-LM run, from its arguments (destination -> str(value), as its TensorBoard
text summaries or a parsed command line hold them): which layers compute, with which fusions and optimizer kernels.

  --transformer-impl local         Megatron Core's own modules: DotProductAttention (unfused), unless --spec names
                                   runs/megatron/megatron_sdpa_spec.py (flash attention through torch's SDPA)
  --transformer-impl transformer_engine (the default)   Transformer Engine's: flash / fused attention, unless
                                   --attention-backend unfused (taken as DotProductAttention's saved set)
  the fusion flags, dropouts, --attention-softmax-in-fp32 (also set by --apply-query-key-layer-scaling, as Megatron's
  validate_args does) and --no-create-attention-mask-in-dataloader as given
  --optimizer adam                 fused Adam with Transformer Engine (its FusedAdam); with the local implementation
                                   torch's AdamW (foreach), Megatron-LM's fallback where neither Transformer Engine
                                   nor Apex is installed (an assumption the arguments cannot settle: `notes` says so)
Anything else (another optimizer, a custom --spec, an implementation the formulas do not know) is named in `notes`.
"""
from __future__ import annotations

import ast

from common.config.implementation_config import (
    FLASH,
    FOREACH_ADAM,
    FUSED_ADAM,
    LOCAL,
    TRANSFORMER_ENGINE,
    UNFUSED,
    ImplementationConfig,
)

SDPA_SPEC = "megatron_sdpa_spec"  # runs/megatron/megatron_sdpa_spec.py's module name


def _flag(arguments: dict[str, str], name: str, default: bool) -> bool:
    value = arguments.get(name)
    return default if value in (None, "None") else value == "True"


def _number(arguments: dict[str, str], name: str) -> float:
    value = arguments.get(name)
    return 0.0 if value in (None, "None") else float(value)


def spec_of(arguments: dict[str, str]) -> list[str]:
    value = arguments.get("spec", "None")
    if value in ("None", "", "[]"):
        return []
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return [value]
    return [str(x) for x in parsed] if isinstance(parsed, (list, tuple)) else [str(parsed)]


def implementation_of(arguments: dict[str, str]) -> tuple[ImplementationConfig, list[str]]:
    """(the implementation, notes on what the formulas assume about it)."""
    notes: list[str] = []
    impl = arguments.get("transformer_impl", TRANSFORMER_ENGINE)
    if impl not in (LOCAL, TRANSFORMER_ENGINE):
        notes.append(f"transformer_impl={impl}: taken as transformer_engine")
        impl = TRANSFORMER_ENGINE
    spec = spec_of(arguments)
    if impl == LOCAL:
        backend = FLASH if spec[:1] == [SDPA_SPEC] else UNFUSED
    else:
        backend = UNFUSED if "unfused" in arguments.get("attention_backend", "") else FLASH
    if spec and spec[:1] != [SDPA_SPEC]:
        notes.append(f"spec={spec}: a custom layer spec; the formulas assume Megatron's own spec")
    optimizer = arguments.get("optimizer", "adam")
    if optimizer != "adam":
        notes.append(f"optimizer={optimizer}: the formulas price Adam's state and step")
    if impl == LOCAL:
        notes.append("local implementation: Adam taken as torch's AdamW (foreach), Megatron-LM's fallback without "
                     "Transformer Engine or Apex")
    config = ImplementationConfig(
        transformer_impl=impl, attention_backend=backend,
        masked_softmax_fusion=_flag(arguments, "masked_softmax_fusion", True),
        attention_softmax_in_fp32=(_flag(arguments, "attention_softmax_in_fp32", False)
                                   or _flag(arguments, "apply_query_key_layer_scaling", False)),
        attention_dropout=_number(arguments, "attention_dropout"),
        hidden_dropout=_number(arguments, "hidden_dropout"),
        gradient_accumulation_fusion=_flag(arguments, "gradient_accumulation_fusion", True),
        embedding_gradient_accumulation_fusion=False,  # Megatron-LM's lookup leaves autograd its dense gradient
        bias_swiglu_fusion=_flag(arguments, "bias_swiglu_fusion", True),
        apply_rope_fusion=_flag(arguments, "apply_rope_fusion", True),
        create_attention_mask=_flag(arguments, "create_attention_mask_in_dataloader", True),
        keeps_iteration_batches=arguments.get("rerun_mode", "validate_results") != "disabled",
        timers_synchronise_passes=_number(arguments, "timing_log_level") >= 2,
        optimizer_impl=FOREACH_ADAM if impl == LOCAL else FUSED_ADAM)
    return config, notes
