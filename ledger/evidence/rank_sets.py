"""Sets of ranks as a person writes them on a command line ("0 1 4-7", "0,1,4-7") and as the ledger writes them back
("0, 1, 4-7")."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Self

from common.config import MAX_WORLD_SIZE
from common.errors import ConfigError


def parse_ranks(items: Iterable[str] | None, flag: str = "--ranks") -> set[int] | None:
    """"0 1 4-7" or "0,1,4-7" -> {0, 1, 4, 5, 6, 7}; None for no items. `flag` names the option in errors."""
    if not items:
        return None
    out: set[int] = set()
    for item in items:
        for part in filter(None, item.split(",")):
            try:
                a, _, b = part.partition("-")
                lo, hi = int(a), int(b or a)
            except ValueError:
                raise ConfigError(f"{flag} {part!r}: expected ranks like 0,1,4-7") from None
            if not 0 <= lo <= hi < MAX_WORLD_SIZE:
                raise ConfigError(f"{flag} {part!r}: expected ranks 0 <= A <= B < {MAX_WORLD_SIZE:,}")
            out.update(range(lo, hi + 1))
    return out


def ranks_text(ranks: Iterable[int]) -> str:
    """{0, 1, 2, 3, 7} -> "0-3, 7": runs of consecutive ranks written as ranges."""
    runs: list[list[int]] = []
    for r in sorted(set(ranks)):
        if runs and r == runs[-1][1] + 1:
            runs[-1][1] = r
        else:
            runs.append([r, r])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


@dataclass(frozen=True)
class RankChoice:
    """Which traced ranks an analysis that costs seconds per rank runs on (`--hta-ranks`, `--replay-ranks`), so that
    its cost stays bounded on a cluster: the first and the last (the default: on a pipeline, its two end stages),
    all, none, or a list."""
    which: str = "ends"  # "ends" | "all" | "none" | "ranks": those in `ranks`
    ranks: frozenset[int] = frozenset()

    @classmethod
    def parse(cls, text: str, flag: str) -> Self:
        """"ends", "all", "none", or ranks like "0,3,8-15"; `flag` names the option in errors."""
        if text in ("ends", "all", "none"):
            return cls(text)
        ranks = parse_ranks([text], flag)
        if not ranks:
            raise ConfigError(f"{flag} {text!r}: expected ends, all, none or ranks like 0,3,8-15")
        return cls("ranks", frozenset(ranks))

    def pick(self, traced: list[int]) -> list[int]:
        """The chosen ones of the (sorted) traced ranks."""
        if self.which == "all":
            return traced
        if self.which == "ends":
            return sorted({traced[0], traced[-1]}) if traced else []
        return [r for r in traced if r in self.ranks]


def left_out(analysis: str, traced: list[int], chosen: list[int], traced_noun: str, all_hint: str) -> list[str]:
    """The `missing` sentence of an analysis that ran on `chosen` of the `traced` ranks ([] when it ran on all):
    which ranks it ran on, which it did not, and the flag that would run it on all."""
    rest = [r for r in traced if r not in chosen]
    if not rest:
        return []
    done = f"on rank(s) {ranks_text(chosen)} only" if chosen else "on no rank"
    return [f"{analysis} run {done} of the {len(traced)} {traced_noun}, not on {ranks_text(rest)} ({all_hint})"]
