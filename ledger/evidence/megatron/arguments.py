"""Megatron-LM's parsed arguments, as its TensorBoard text summaries hold them (name -> str(value), after Megatron's
own validation: derived sizes filled in, defaults applied), turned into the flags our Megatron flag parser reads.

Why flags, not a config built directly: the flag parser and `resolve` are the one place where Megatron's names
become a RunConfig (common.arguments), for `plan`, `train` and runs/megatron/run.sh's argv alike; this module only
says which argument feeds which flag. Where Megatron's name or meaning differs from our flag's:
  * --norm-epsilon is stored as layernorm_epsilon; --disable-bias-linear as add_bias_linear=False;
  * num_query_groups counts only with group_query_attention (Megatron's core_transformer_config_from_args);
  * a command line's --num-virtual-stages-per-pipeline-rank is the virtual pipeline size (validate_args);
  * the vocabulary is padded_vocab_size: the tokenizer's vocabulary as Megatron padded it (vocab_size is None for a
    real tokenizer; padding an already padded size changes nothing), whichever tokenizer made it (a command line,
    which has no padded_vocab_size, gives its --vocab-size);
  * the torch profiler runs only with --profile as well as --use-pytorch-profiler.
The layer's flavour is read with Megatron's semantics (common.arguments megatron_model): SwiGLU or the GeLU MLP,
biases or none, RMSNorm or LayerNorm, RoPE or learned positions are all modelled. A value our flags cannot take (a
choice the formulas do not implement), and an argument whose value the formulas assume (no QKV bias, dense, no FP8,
...), is listed as not modelled, never guessed at nor silently dropped.
"""
from __future__ import annotations

import argparse
import ast
import dataclasses
from pathlib import Path

from common.arguments import build_parser, resolve
from common.config import RunConfig, validate
from common.errors import ConfigError, InputError
from common.megatron.flag_effects import IMPLEMENTATION_DESTS
from common.megatron.implementation import implementation_of

# Megatron arguments whose value the formulas assume; another value is named as not modelled. Absent ones (other
# Megatron versions) are not judged.
ASSUMED = {"add_qkv_bias": "False", "qk_layernorm": "False",
           "multi_latent_attention": "False", "mtp_num_layers": "None", "fp8": "None",
           "fp4": "None", "cross_entropy_loss_fusion": "False", "use_precision_aware_optimizer": "False",
           "optimizer_cpu_offload": "False", "use_torch_fsdp2": "False", "use_megatron_fsdp": "False"}


def our_view(arguments: dict[str, str]) -> dict[str, str]:
    """The arguments under our flags' destination names, where Megatron's differ (see the module docstring)."""
    view = dict(arguments)
    view["norm_epsilon"] = arguments.get("layernorm_epsilon", "None")
    view["disable_bias_linear"] = str(arguments.get("add_bias_linear") == "False")
    if arguments.get("group_query_attention") != "True":
        view["num_query_groups"] = "None"
    stages = arguments.get("num_virtual_stages_per_pipeline_rank", "None")
    if stages != "None" and arguments.get("virtual_pipeline_model_parallel_size", "None") == "None":
        view["virtual_pipeline_model_parallel_size"] = stages  # Megatron's validate_args derives it so
    if arguments.get("padded_vocab_size", "None") != "None":
        view["vocab_size"] = arguments["padded_vocab_size"]
    view["tokenizer_type"] = "None"  # which tokenizer made the vocabulary changes no formula
    view["use_pytorch_profiler"] = str(arguments.get("profile") == "True"
                                       and arguments.get("use_pytorch_profiler") == "True")
    return view


def flags_from_arguments(arguments: dict[str, str], parser: argparse.ArgumentParser) -> tuple[list[str], list[str]]:
    """(argv for `parser`, "name=value" of the arguments the formulas do not model). A dense run's MoE knobs (Megatron
    logs its defaults, e.g. moe_token_dispatcher_type=allgather, with num_experts None) describe nothing that ran.
    The implementation's arguments (--attention-backend among them) are implementation_of's to read, not flags."""
    view = our_view(arguments)
    dense = view.get("num_experts") in (None, "None")
    argv: list[str] = []
    unmodelled = [f"{name}={arguments[name]}" for name, value in ASSUMED.items()
                  if name in arguments and arguments[name] != value]
    for action in parser._actions:  # noqa: SLF001 - argparse offers no public list of a parser's options
        value = view.get(action.dest)
        if (not action.option_strings or value in (None, "None") or (dense and action.dest.startswith("moe_"))
                or action.dest in IMPLEMENTATION_DESTS):
            continue
        flag = action.option_strings[0]
        if action.nargs == 0:  # a switch: store_true (Megatron's value "True") or store_false ("False")
            if value == str(action.const):
                argv.append(flag)
        elif action.choices is not None and value not in action.choices:
            unmodelled.append(f"{action.dest}={value}")
        elif action.nargs == "+":
            items = _list(value)
            if items:
                argv += [flag, *map(str, items)]
        else:
            argv += [flag, value]
    return argv, unmodelled


def _list(value: str) -> list[object]:
    """A list argument as str() wrote it ("[0, 1]"); anything else is one item."""
    try:
        parsed = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return [value]
    return list(parsed) if isinstance(parsed, (list, tuple)) else [parsed]


def run_config_of(arguments: dict[str, str], world_size: int, path: Path | str,
                  source: str = "arguments") -> tuple[RunConfig, list[str], list[str]]:
    """The RunConfig of Megatron-LM arguments (recorded or parsed from a command line), with the implementation they
    select (common/megatron/implementation.py); "name=value" of the arguments the formulas do not model; what the
    implementation assumes where the arguments cannot tell. A config Megatron-LM would refuse is an InputError
    naming `path` and `source`."""
    parser = build_parser("megatron-lm", megatron_model=True)
    argv, unmodelled = flags_from_arguments(arguments, parser)
    ns, _ = parser.parse_known_args(argv)
    ns.run_dir = None
    implementation, notes = implementation_of(arguments)
    try:
        cfg = resolve(ns, world_size=world_size, megatron_model=True)  # its layer flavour, as Megatron reads it
        cfg = dataclasses.replace(cfg, implementation=implementation)
        validate(cfg)
    except ConfigError as exc:
        raise InputError(path, f"{source}: {exc}") from None
    return cfg, unmodelled, notes
