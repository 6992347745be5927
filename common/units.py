"""Human units for the ledger's raw figures (bytes, seconds, fractions), one place so every page reads alike."""
from __future__ import annotations


def human(value: float | None, unit: str) -> str:
    if value is None:
        return "—"
    if unit == "bytes":
        return human_bytes(value)
    if unit == "fraction":
        return f"{value:.2%}" if abs(value) >= 1e-4 else f"{value:.2e}"
    if unit == "s":
        return f"{value * 1e3:.3f} ms"
    if unit == "bytes/param":
        return f"{value:.2f} B/param"
    return f"{value:,.4g} {unit}"


def human_bytes(value: float) -> str:
    for scale, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if abs(value) >= scale:
            return f"{value / scale:,.2f} {name}"
    return f"{value:,.0f} B"
