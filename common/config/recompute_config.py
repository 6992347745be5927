"""Activation recompute (Megatron's TransformerConfig recompute fields), and its checks."""
from __future__ import annotations

from dataclasses import dataclass

from common.errors import ConfigError


@dataclass
class RecomputeConfig:
    """Activation recompute, Megatron's TransformerConfig fields. granularity None | "full" (whole layers, cut per
    model chunk by method "uniform": groups of num_layers, or "block": the first num_layers one by one) |
    "selective" (core attention only). Rules: check_recompute; what each saves: docs/formulas.md ("Recompute")."""
    recompute_granularity: str | None = None
    recompute_method: str | None = None
    recompute_num_layers: int | None = None


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
