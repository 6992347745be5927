"""The H200 file as it was before its short-sequence attention grid (2026-12-05): flash attention curves from seq
2048 up, shorter sequences priced at seq 2048's. What the held-out launch-bound runs were first predicted with."""
from __future__ import annotations

import dataclasses

from ledger.models.simulate.hardware import Hardware, load_hardware


def without_short_attention() -> Hardware:
    hw = load_hardware("H200")

    def keep(by_dim):
        return tuple((d, tuple((seq, curve) for seq, curve in by_seq if seq >= 2048)) for d, by_seq in by_dim)

    return dataclasses.replace(hw, attention=dataclasses.replace(hw.attention, fwd=keep(hw.attention.fwd),
                                                                 bwd=keep(hw.attention.bwd)))
