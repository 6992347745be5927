"""Pipeline bubble, under each of its conventions (always reported with the convention's name).

With p stages, m micro-batches per DP replica per step, v model chunks per stage (1 = plain 1F1B) and equal forward
+ backward time per micro-batch per chunk, each stage idles for (p - 1) chunk-slots of 1/v micro-batch time while
computing for m micro-batches (Narayanan et al. 2021, sec. 2.2):
- "of_wall_time":        bubble / (bubble + compute) = (p - 1) / (v m + p - 1)   (1/9 for the reference run: p 2, m 8)
- "relative_to_compute": bubble / compute            = (p - 1) / (v m)           (Megatron's paper convention)
"""
from __future__ import annotations

from dataclasses import dataclass

OF_WALL_TIME = "of_wall_time: (p-1)/(v*m+p-1)"
RELATIVE_TO_COMPUTE = "relative_to_compute: (p-1)/(v*m)"


@dataclass(frozen=True)
class Bubble:
    of_wall_time: float
    relative_to_compute: float


def bubble(p: int, m: int, v: int = 1) -> Bubble:
    return Bubble(of_wall_time=(p - 1) / (v * m + p - 1), relative_to_compute=(p - 1) / (v * m))


def of_wall_time_text(p: int, m: int, v: int = 1) -> str:
    """The of-wall-time formula with the run's numbers in it, as reports and the CLI print it."""
    if v == 1:
        return f"(p-1)/(m+p-1) = {p - 1}/{m + p - 1}"
    return f"(p-1)/(V*m+p-1) = {p - 1}/{v * m + p - 1}"
