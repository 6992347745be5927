"""Counts in words: "1 micro-batch", "8 micro-batches", so no line a user reads says "1 calls"."""
from __future__ import annotations


def plural(count: int, noun: str) -> str:
    """`count` with `noun`, pluralised unless the count is one (thousands separated): plural(1, "call") == "1 call",
    plural(8, "micro-batch") == "8 micro-batches", plural(2048, "token") == "2,048 tokens"."""
    if count == 1:
        return f"1 {noun}"
    suffix = "es" if noun.endswith(("s", "x", "ch", "sh")) else "s"
    return f"{count:,} {noun}{suffix}"
