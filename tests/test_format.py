"""ledger.present.units, the one formatter of every figure a person reads: a table of inputs and the strings they must
become, and the rules every string obeys (no 'None', no exponent notation, a unit on every figure)."""
from __future__ import annotations

import math
import re

import pytest

from ledger.present import units

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30


@pytest.mark.parametrize("value, unit, text", [
    # missing, in every unit
    (None, "bytes", "—"), (None, "s", "—"), (math.nan, "fraction", "—"), (None, "", "—"),
    # bytes: binary units by magnitude, two decimals; below 1 KiB the exact count
    (0, "bytes", "0 B"), (512, "bytes", "512 B"), (KiB, "bytes", "1.00 KiB"), (943_104, "bytes", "921.00 KiB"),
    (1.5 * MiB, "bytes", "1.50 MiB"), (4_500_000_000, "bytes", "4.19 GiB"), (3 * (1 << 40), "bytes", "3.00 TiB"),
    # seconds: ns / µs / ms / s by magnitude, three significant digits; 0.99996 s rounds to 1.00 s, not 1,000 ms
    (8.5e-8, "s", "85.0 ns"), (0.000481, "s", "481 µs"), (0.044589, "s", "44.6 ms"), (2.5159, "s", "2.52 s"),
    (0.99996, "s", "1.00 s"), (0.0, "s", "0 ns"), (-2.4e-17, "s", "0 ns"), (125.0, "s", "125 s"),
    # fractions as percentages; whole percent from 100% up; tiny ones keep two significant digits
    (0.1111, "fraction", "11.11%"), (1.0, "fraction", "100%"), (0.99999, "fraction", "100%"),
    (3.2, "fraction", "320%"), (1e-6, "fraction", "0.00010%"), (0.0, "fraction", "0.00%"),
    # counts and rates with thousands separators, never an exponent
    (1_196_030.0, "tokens/s", "1,196,030 tokens/s"), (268.1, "tokens/s", "268 tokens/s"),
    (16_384, "tokens", "16,384 tokens"), (0, "count", "0"), (12_345_678, "count", "12,345,678"),
    (62.0, "counts", "62 counts"), (0.5, "counts", "0.500 counts"),
    # FLOP/s with SI prefixes (the ledger's unit is TFLOP/s)
    (5.168e-05, "TFLOP/s", "51.7 MFLOP/s"), (207.3, "TFLOP/s", "207 TFLOP/s"), (1.5e3, "TFLOP/s", "1.50 PFLOP/s"),
    # the ledger's dimensionless units
    (12.01, "bytes/param", "12.01 B/param"), (1.617, "ratio", "1.62×"), (0.98, "x mean", "0.98× mean"),
    # any other unit: a plain number, then the unit
    (3.923e-05, "", "0.0000392"), (1234.5, "widgets", "1,234 widgets"),
])
def test_value_in_every_unit(value, unit, text):
    assert units.value(value, unit) == text


@pytest.mark.parametrize("relative, absolute, unit, text", [
    (0.25, 0.0, "s", "25.00%"), (0.25, None, "s", "25.00%"),  # relative alone
    (0.0, 1e-3, "s", "1.00 ms"), (0.0, 0.5, "counts", "0.500 counts"),  # an absolute floor alone, in the row's unit
    (0.25, 2e-4, "s", "25.00% or 200 µs"),  # either: ok within the larger
])
def test_a_tolerance_reads_as_its_verdict_judges(relative, absolute, unit, text):
    assert units.tolerance(relative, absolute, unit) == text


@pytest.mark.parametrize("values, unit, text", [
    ([943_104, 944_640, 944_128], "bytes", "921.00–922.50 KiB"),  # one scale, the unit written once
    ([0.0005, 0.0012], "s", "0.500–1.20 ms"),  # the largest value's scale, never µs beside ms
    ([0.25, 0.4], "fraction", "25.00%–40.00%"),
    ([12.0, 12.01], "bytes/param", "12.00–12.01 B/param"),
    ([0.87, 1.13], "x mean", "0.87×–1.13× mean"),
    ([0.00099999, 0.001], "s", "1.00 ms"),  # equal as written: one value
    ([None, 7, None], "count", "7"),
    ([None], "s", "—"), ([], "bytes", "—"),
])
def test_span_is_one_range_on_one_scale(values, unit, text):
    assert units.span(values, unit) == text


@pytest.mark.parametrize("largest, unit, scale", [
    (600 * MiB, "bytes", (MiB, "MiB")), (2.5 * GiB, "bytes", (GiB, "GiB")), (0.75, "s", (1e-3, "ms")),
    (2.5, "s", (1.0, "s")), (0.4, "fraction", (0.01, "%")), (7.0, "tokens/s", (1.0, "tokens/s")),
])
def test_axis_scale_names_the_unit_of_the_axis(largest, unit, scale):
    assert units.axis_scale(largest, unit) == scale


def test_exact_gives_the_count_behind_a_rounded_figure():
    assert units.exact(943_104, "bytes") == "943,104 B"
    assert units.exact(0.0446, "s") == "44,600.000 µs"
    assert units.exact(None, "bytes") == "—"


@pytest.mark.parametrize("text, plain", [
    ("7.896e+08 FLOPs per step", "7.896×10⁸ FLOPs per step"),
    ("bubble 2.17e-16 ms", "bubble 2.17×10⁻¹⁶ ms"),
    ("x 2.5e-03 and 1e+05 tokens", "x 0.0025 and 100,000 tokens"),
    ("rank1e3 and v1.2e5 stay", "rank1e3 and v1.2e5 stay"),  # inside a word: not a number
])
def test_plain_writes_exponent_notation_for_people(text, plain):
    assert units.plain(text) == plain


def test_ranks_are_compacted_into_runs():
    assert units.ranks([5, 0, 1, 2, 3, 7, 8]) == "0–3, 5, 7–8"
    assert units.ranks([4]) == "4"


@pytest.mark.parametrize("unit", ["bytes", "s", "fraction", "count", "tokens/s", "TFLOP/s", "ratio", ""])
def test_no_figure_is_none_nan_or_exponent(unit):
    for exponent in range(-15, 16):
        for mantissa in (1.0, 1.19603, -7.5):
            text = units.value(mantissa * 10.0 ** exponent, unit)
            assert not re.search(r"\de[+-]?\d|None|nan|inf", text), (mantissa, exponent, unit, text)
