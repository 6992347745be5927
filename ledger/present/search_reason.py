"""Why a layout of `train-ledger search` loses to the first, as one line a person reads, e.g.
"pipeline bubble +210 ms (tp 1 vs 2, pp 4 vs 2): 826 vs 909 tokens/s (-9.1%)": the growth in the one formatter's
units (a toy model's 0.4 ms reads "+400 µs", not "+0.000 s")."""
from __future__ import annotations

from ledger.models.simulate.search import LosingReason
from ledger.present.units import duration


def reason_text(reason: LosingReason) -> str:
    term = f"{reason.term} +{duration(reason.growth_s)}" if reason.term is not None else "no term larger"
    changes = ", ".join(f"{knob} {mine} vs {theirs}" for knob, mine, theirs in reason.changes) or "same layout"
    change = (reason.tokens_per_s / reason.first_tokens_per_s - 1) * 100
    return (f"{term} ({changes}): {reason.tokens_per_s:,.0f} vs {reason.first_tokens_per_s:,.0f} tokens/s "
            f"({change:+.1f}%)")
