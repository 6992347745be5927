"""Megatron's data flags, parsed without reading any data: `--data-path` (one prefix, or a weighted blend
`0.7 A 0.3 B`) and `--split` (train,valid,test weights over the documents, e.g. 98,2,0). Torch-free, so that bad
values are one line and exit 2 at flag-parsing time, before any rank starts."""
from __future__ import annotations

from common.errors import ConfigError


def parse_blend(data_path: list[str]) -> list[tuple[float, str]]:
    """[(weight, prefix)], the weights normalised to sum to 1. One prefix alone has weight 1; otherwise Megatron's
    alternating list WEIGHT PREFIX WEIGHT PREFIX ..."""
    if not data_path:
        raise ConfigError("--data-path needs a prefix (or weighted prefixes: 0.7 A 0.3 B)")
    if len(data_path) == 1:
        return [(1.0, data_path[0])]
    if len(data_path) % 2:
        raise ConfigError(f"--data-path {' '.join(data_path)}: a blend is pairs of WEIGHT PREFIX; got an odd count")
    blend = []
    for weight, prefix in zip(data_path[0::2], data_path[1::2]):
        try:
            value = float(weight)
        except ValueError:
            raise ConfigError(f"--data-path: blend weight {weight!r} (before {prefix}) is not a number") from None
        if not 0 < value < float("inf"):
            raise ConfigError(f"--data-path: blend weight {weight} (before {prefix}) must be a positive number")
        blend.append((value, prefix))
    total = sum(w for w, _ in blend)
    return [(w / total, prefix) for w, prefix in blend]


def parse_split(split: str) -> tuple[float, float, float]:
    """Megatron's --split: up to three comma-separated non-negative weights (missing ones are 0), normalised."""
    parts = [p.strip() for p in split.replace("/", ",").split(",")]
    try:
        values = [float(p) for p in parts]
    except ValueError:
        raise ConfigError(f"--split {split!r}: expected up to three numbers, e.g. 98,2,0") from None
    if len(values) > 3 or any(not 0 <= v < float("inf") for v in values) or sum(values) <= 0:
        raise ConfigError(f"--split {split!r}: expected up to three non-negative numbers with a positive sum")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return values[0] / total, values[1] / total, values[2] / total
