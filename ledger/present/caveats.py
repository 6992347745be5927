"""Caveats stated once: the clauses that many explanations repeat become numbered notes, cited by number.

An explanation is a sentence of clauses joined by "; " (the ledger appends its caveats that way: "not measured on
CPU ...", "8 ranks share host vm's 2 cores: ...", "no prediction: the time model ... is not wired"). A clause
after the first that at least MIN_NOTE_LINES explanations carry, and that is long enough to be worth a number,
becomes a note; clauses that always follow each other (one caveat written with a "; " inside it) make one note. The
first clause of an explanation always stays inline: it says what the figure is. Notes are numbered from the most
cited down, so [1] is the caveat that touches most of the report.
"""
from __future__ import annotations

from collections import Counter, defaultdict
from dataclasses import dataclass, field

SEPARATOR = "; "
MIN_NOTE_CHARS = 30  # a shorter clause costs less inline than a reference to it
MIN_NOTE_LINES = 3  # a clause two lines share is more often a coincidence of figures than a caveat


def clauses(text: str) -> list[str]:
    """`text` split at "; " outside parentheses, brackets and quotes."""
    out, depth, start, i = [], 0, 0, 0
    while i < len(text):
        ch = text[i]
        if ch in "([":
            depth += 1
        elif ch in ")]":
            depth = max(0, depth - 1)
        elif depth == 0 and text.startswith(SEPARATOR, i):
            out.append(text[start:i])
            start = i + len(SEPARATOR)
            i = start
            continue
        i += 1
    out.append(text[start:])
    return [c.strip() for c in out if c.strip()]


@dataclass
class Cited:
    """An explanation with its notes taken out: the inline text and the numbers of the notes it cites."""
    text: str
    notes: list[int]

    def inline(self) -> str:
        return self.text + ("".join(f" [{n}]" for n in self.notes))


@dataclass
class Notes:
    """Numbered notes (1-based, most cited first) and how many explanations cite each."""
    texts: list[str] = field(default_factory=list)
    cited_by: list[int] = field(default_factory=list)
    _chains: dict[str, tuple[str, ...]] = field(default_factory=dict)

    @classmethod
    def of(cls, explanations: list[str]) -> "Notes":
        split = [clauses(e) for e in explanations]
        counts = Counter(c for parts in split for c in set(parts[1:]))
        repeated = {c for c, n in counts.items() if n >= MIN_NOTE_LINES and len(c) >= MIN_NOTE_CHARS}
        notes = cls(_chains=_chains(split, repeated))
        cited: Counter[str] = Counter(SEPARATOR.join(c) for parts in split for c in notes._walk(parts)[1])
        order = sorted(cited, key=lambda text: -cited[text])  # stable: ties keep their first citation's order
        notes.texts, notes.cited_by = order, [cited[text] for text in order]
        return notes

    def _walk(self, parts: list[str]) -> tuple[list[str], list[tuple[str, ...]]]:
        """(inline clauses, note chains in order, each once) of one explanation's clauses."""
        inline: list[str] = []
        cited: list[tuple[str, ...]] = []
        i = 0
        while i < len(parts):
            chain = self._chains.get(parts[i]) if i > 0 else None
            if chain and tuple(parts[i:i + len(chain)]) == chain:
                if chain not in cited:
                    cited.append(chain)
                i += len(chain)
            else:
                inline.append(parts[i])
                i += 1
        return inline, cited

    def cite(self, explanation: str) -> Cited:
        inline, chains = self._walk(clauses(explanation))
        numbers = [self.texts.index(SEPARATOR.join(c)) + 1 for c in chains if SEPARATOR.join(c) in self.texts]
        return Cited(SEPARATOR.join(inline), sorted(numbers))


def _chains(split: list[list[str]], repeated: set[str]) -> dict[str, tuple[str, ...]]:
    """Repeated clauses grouped into the runs they always appear in: clause b joins a's chain when b always comes
    right after a and a always right before b. Keyed by each chain's first clause."""
    after: dict[str, set[str | None]] = defaultdict(set)
    before: dict[str, set[str | None]] = defaultdict(set)
    for parts in split:
        for i, c in enumerate(parts):
            if c in repeated:
                after[c].add(parts[i + 1] if i + 1 < len(parts) else None)
                before[c].add(parts[i - 1] if i > 0 else None)
    joined = {a: b for a in repeated for b in [next(iter(after[a]))] if len(after[a]) == 1
              and b in repeated and before[b] == {a}}
    chains: dict[str, tuple[str, ...]] = {}
    for start in repeated - set(joined.values()):
        chain = [start]
        while chain[-1] in joined and joined[chain[-1]] not in chain:
            chain.append(joined[chain[-1]])
        chains[start] = tuple(chain)
    return chains
