"""The one formatter for every figure a person reads: the report (markdown and HTML), the dashboard and the CLI's
summaries. Files meant for programs (reconciliation.json / .csv, `--json`) keep the raw numbers; this module never
feeds them.

Rules, so that every page reads alike:
  * missing is "—", never "None" or "nan"; no figure is ever printed in exponent notation;
  * bytes in binary units chosen by magnitude (B, KiB, MiB, GiB, TiB), two decimals; `exact` gives the exact count
    (for a hover title beside the rounded figure);
  * durations in ns / µs / ms / s chosen by magnitude, three significant digits; every value carries its own unit,
    so no column header can claim seconds over values in milliseconds;
  * fractions as percentages (two decimals, whole percent from 100% up); counts with thousands separators;
  * rates in FLOP/s and FLOP counts with SI prefixes (MFLOP/s ... PFLOP/s);
  * `span` writes min–max of a set of values on one scale (the largest value's), `axis_scale` gives a chart axis
    its divisor and unit label by the same rules.
"""
from __future__ import annotations

import math
import re
from typing import Iterable

DASH = "—"
EN_DASH = "–"
BYTE_UNITS = ((1 << 40, "TiB"), (1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB"), (1, "B"))
TIME_UNITS = ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs"), (1e-9, "ns"))
NOISE_S = 1e-12  # a duration below a picosecond is floating-point noise of a difference of timestamps: 0
SI_PREFIXES = ((1e18, "E"), (1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""))
# The ledger's row units that are a plain word after a number, and how the word is written.
WORD_UNITS = {"tokens": "tokens", "tokens/s": "tokens/s", "bytes/param": "B/param", "counts": "counts"}
EXPONENT = re.compile(r"(?<![\w.])(-?\d+(?:\.\d+)?)e([+-]?\d+)\b")
SUPERSCRIPT = str.maketrans("-0123456789", "⁻⁰¹²³⁴⁵⁶⁷⁸⁹")


def missing(x: object) -> bool:
    """None, or a float NaN (pandas' missing value)."""
    return x is None or (isinstance(x, float) and math.isnan(x))


def significant(x: float, digits: int = 3) -> str:
    """`x` to `digits` significant digits in plain decimal notation (no exponent), thousands separated."""
    if x == 0 or not math.isfinite(x):
        return "0" if x == 0 else str(x)
    x = float(f"{x:.{digits}g}")  # round first: 0.99999 becomes 1 and gets 1's decimals
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x))))
    return f"{x:,.{decimals}f}"


def _scale(x: float, units: tuple[tuple[float, str], ...]) -> tuple[float, str]:
    """The largest unit not above |x| (the smallest unit for 0 and for anything below it)."""
    for size, name in units:
        if abs(x) >= size:
            return size, name
    return units[-1]


def size(n: float | None, unit: tuple[float, str] | None = None) -> str:
    """Bytes: '512 B', '921.00 KiB', '4.19 GiB' (or in the given (divisor, name) unit)."""
    if missing(n):
        return DASH
    divisor, name = unit or _scale(n, BYTE_UNITS)
    return f"{n:,.0f} B" if name == "B" else f"{n / divisor:,.2f} {name}"


def duration(seconds: float | None, unit: tuple[float, str] | None = None) -> str:
    """Seconds: '85.0 ns', '481 µs', '44.6 ms', '2.52 s' (or in the given (divisor, name) unit)."""
    if missing(seconds):
        return DASH
    if abs(seconds) < NOISE_S:
        seconds = 0.0
    divisor, name = unit or _scale(float(f"{seconds:.3g}"), TIME_UNITS)  # 0.99996 s is 1.00 s, not 1,000 ms
    return f"{significant(seconds / divisor)} {name}"


def percent(x: float | None, signed: bool = False) -> str:
    """A fraction as a percentage: 0.1111 -> '11.11%', 1.0 -> '100%', 3.2 -> '320%'; `signed` writes '+'."""
    if missing(x):
        return DASH
    p = round(x * 100, 2) if abs(x) >= 1e-4 else x * 100
    sign = "+" if signed and p > 0 else ""
    if abs(p) >= 100:
        return f"{sign}{p:,.0f}%"
    if 0 < abs(p) < 0.01:
        return f"{sign}{significant(p, 2)}%"
    return f"{sign}{p:.2f}%"


def count(n: float | None) -> str:
    """A count: '1,234,567'; a fractional one to three significant digits."""
    if missing(n):
        return DASH
    if float(n).is_integer() or abs(n) >= 1000:
        return f"{n:,.0f}"
    return significant(n)


def si(x: float | None, unit: str) -> str:
    """`x` in `unit` with an SI prefix: si(5.2e7, 'FLOP/s') -> '52.0 MFLOP/s'."""
    if missing(x):
        return DASH
    divisor, prefix = _scale(x, SI_PREFIXES)
    return f"{significant(x / divisor)} {prefix}{unit}"


def value(x: float | None, unit: str) -> str:
    """A reconciliation figure in its row's unit (the ledger's units: bytes, s, fraction, ratio, x mean, count,
    tokens, tokens/s, bytes/param, TFLOP/s); any other unit is written after a plain number."""
    if missing(x):
        return DASH
    if unit == "bytes":
        return size(x)
    if unit == "s":
        return duration(x)
    if unit == "fraction":
        return percent(x)
    if unit in ("ratio", "x mean"):
        return f"{x:.2f}×" + (" mean" if unit == "x mean" else "")
    if unit == "count":
        return count(x)
    if unit == "TFLOP/s":
        return si(x * 1e12, "FLOP/s")
    if unit == "bytes/param":
        return f"{x:.2f} B/param"
    text = count(x) if unit in WORD_UNITS else significant(x) if abs(x) < 1000 else f"{x:,.0f}"
    word = WORD_UNITS.get(unit, unit)
    return f"{text} {word}".rstrip()


def tolerance(relative: float, absolute: float | None, unit: str) -> str:
    """A row's tolerance as its verdict reads it (ledger/reconcile/rows.py judge): relative, or an absolute floor in
    the row's unit, or either: '25.00%', '1.00 ms', '25.00% or 200 µs'."""
    if missing(absolute) or not absolute:
        return percent(relative)
    floor = value(absolute, unit)
    return f"{percent(relative)} or {floor}" if relative else floor


def exact(x: float | None, unit: str) -> str:
    """The exact figure behind a rounded one, for a hover title: bytes as a whole count, seconds in µs to the ns."""
    if missing(x):
        return DASH
    if unit == "bytes":
        return f"{x:,.0f} B"
    if unit == "s":
        return f"{x * 1e6:,.3f} µs"
    return value(x, unit)


def axis_scale(largest: float, unit: str) -> tuple[float, str]:
    """(divisor, label) for a chart axis whose largest value is `largest`: bytes and seconds pick their unit by
    magnitude, fractions become percent; anything else is left as is."""
    if unit == "bytes":
        return _scale(largest, BYTE_UNITS)
    if unit == "s":
        return _scale(largest, TIME_UNITS)
    if unit == "fraction":
        return 0.01, "%"
    return 1.0, unit


def span(values: Iterable[float | None], unit: str) -> str:
    """min–max of the present values on one scale (the largest's), or the one value when they agree as written;
    '—' when none is present."""
    present = [v for v in values if not missing(v)]
    if not present:
        return DASH
    low, high = min(present), max(present)
    if unit in ("bytes", "s"):
        scale = axis_scale(max(abs(low), abs(high)), unit)
        one = size if unit == "bytes" else duration
        a, b = one(low, scale), one(high, scale)
        if a == b:
            return a
        return f"{a.rsplit(' ', 1)[0]}{EN_DASH}{b}"
    a, b = value(low, unit), value(high, unit)
    if a == b:
        return a
    (a_number, _, a_unit), (_, _, b_unit) = a.partition(" "), b.partition(" ")
    return f"{a_number if a_unit and a_unit == b_unit else a}{EN_DASH}{b}"


def plain(text: str) -> str:
    """Free text (an explanation the ledger wrote) with every exponent-notation number written for a person:
    '7.896e+08 FLOPs' -> '7.896×10⁸ FLOPs', '2.5e-03' -> '0.0025'."""
    def one(m: re.Match[str]) -> str:
        mantissa, exponent = m.group(1), int(m.group(2))
        if -4 <= exponent < 6:
            return significant(float(m.group(0)), max(1, len(mantissa.replace("-", "").replace(".", ""))))
        return f"{mantissa}×10{str(exponent).translate(SUPERSCRIPT)}"
    return EXPONENT.sub(one, text)


def ranks(numbers: Iterable[int]) -> str:
    """Rank numbers compacted into runs: [0, 1, 2, 3, 5] -> '0–3, 5'."""
    out: list[str] = []
    ordered = sorted(set(numbers))
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        out.append(str(ordered[i]) if i == j else f"{ordered[i]}{EN_DASH}{ordered[j]}")
        i = j + 1
    return ", ".join(out)


def rank_label(rank: int, coords: dict[str, int]) -> str:
    """'rank 5 (tp1 dp0 pp1)': a rank and its place in the layout."""
    return f"rank {rank} (tp{coords.get('tp', 0)} dp{coords.get('dp', 0)} pp{coords.get('pp', 0)})"
