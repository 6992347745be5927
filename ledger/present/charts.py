"""Inline SVG charts for report.html: horizontal bars on a labelled axis, each chart with a caption saying what to look
for, and an empty chart replaced by a sentence saying why it is empty.

One shape serves every chart of the report (memory waterfall, pipeline timeline, bucket overlap): a bar per row
label, made of segments placed on an x axis in the chart's unit (bytes or seconds), scaled and labelled by
ledger.present.units (`axis_scale`), plus optional tick marks (NVML's device total). Every chart has an x-axis title
with its unit, a y-axis title and a legend; each segment carries a hover title with its exact figure.
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass, field

from ledger.present import units as fmt

PLOT_WIDTH, RIGHT = 600, 20
BAR, GAP, TOP = 14, 6, 28  # TOP leaves room for the y-axis title above the bar labels
AXIS_HEIGHT, LEGEND_ROW = 44, 18
CHAR = 6.5  # px per character of 11px text: enough to keep labels off the axis title


@dataclass
class Segment:
    start: float  # in the chart's unit (bytes, seconds)
    length: float
    color: str
    title: str  # hover text: what the segment is, with its exact figure


@dataclass
class Bar:
    label: str
    segments: list[Segment]
    marks: list[tuple[float, str]] = field(default_factory=list)  # (x, hover title): a vertical tick


@dataclass
class Chart:
    bars: list[Bar]
    unit: str  # "bytes" | "s"
    x_title: str  # what the x axis measures; the unit is appended
    y_title: str
    legend: list[tuple[str, str]]  # (color, name)
    caption: str  # one line: what to look for


def nice_ticks(largest: float, target: int = 5) -> list[float]:
    """0 and round steps (1, 2 or 5 x 10^k) up to the first at or beyond `largest`."""
    if largest <= 0:
        return [0.0, 1.0]
    raw = largest / target
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    count = math.ceil(largest / step - 1e-9)
    return [i * step for i in range(count + 1)]


def tick_label(t: float, step: float) -> str:
    """A tick value with the decimals its step needs: 0, 0.5, 1.0, 1.5 / 0, 200, 400."""
    decimals = max(0, -math.floor(math.log10(step))) if step > 0 else 0
    return f"{t:,.{decimals}f}"


def legend(items: list[tuple[str, str]], left: float, top: float, width: float) -> tuple[list[str], float]:
    """Legend entries (color swatch and name) wrapped to `width`; the SVG parts and the height they take."""
    parts, x, y = [], left, top
    for color, name in items:
        item = 22 + CHAR * len(name)
        if x > left and x + item > left + width:
            x, y = left, y + LEGEND_ROW
        parts.append(f"<rect x='{x:.0f}' y='{y}' width='10' height='10' fill='{color}'/>"
                     f"<text x='{x + 14:.0f}' y='{y + 9}'>{html.escape(name)}</text>")
        x += item
    return parts, y - top + LEGEND_ROW


def empty(title: str, why: str) -> str:
    """What a chart with nothing to draw shows instead: its name and why it is empty."""
    return f"<p class='empty'><b>{html.escape(title)}: nothing to draw.</b> {html.escape(why)}</p>"


def render(chart: Chart) -> str:
    """The chart as <figure>: SVG with axes, ticks, legend and hover titles, then its caption. Only the legend
    entries whose colour some segment uses are shown."""
    e = html.escape
    largest = max([s.start + s.length for b in chart.bars for s in b.segments]
                  + [x for b in chart.bars for x, _ in b.marks] + [0.0])
    divisor, unit_name = fmt.axis_scale(largest, chart.unit)
    ticks = nice_ticks(largest / divisor)
    scale = PLOT_WIDTH / (ticks[-1] * divisor)
    left = 12 + CHAR * max([len(b.label) for b in chart.bars] + [len(chart.y_title)])
    plot_height = TOP + (BAR + GAP) * len(chart.bars)
    used = {s.color for b in chart.bars for s in b.segments if s.length > 0}
    keys, legend_height = legend([(c, n) for c, n in chart.legend if c in used], left, plot_height + AXIS_HEIGHT,
                                 PLOT_WIDTH)
    height = plot_height + AXIS_HEIGHT + legend_height
    out = [f"<figure><svg width='{left + PLOT_WIDTH + RIGHT:.0f}' height='{height}' "
           "xmlns='http://www.w3.org/2000/svg' role='img'>"]
    for i, bar in enumerate(chart.bars):
        y = TOP + (BAR + GAP) * i
        out.append(f"<text x='{left - 6}' y='{y + BAR - 3}' text-anchor='end'>{e(bar.label)}</text>")
        for s in (s for s in bar.segments if s.length > 0):
            out.append(f"<rect x='{left + s.start * scale:.1f}' y='{y}' width='{max(s.length * scale, 0.5):.1f}' "
                       f"height='{BAR}' fill='{s.color}' stroke='#fff' stroke-width='0.5'>"
                       f"<title>{e(s.title)}</title></rect>")
        for x, title in bar.marks:
            out.append(f"<line x1='{left + x * scale:.1f}' x2='{left + x * scale:.1f}' y1='{y - 2}' "
                       f"y2='{y + BAR + 2}' stroke='#000' stroke-width='2'><title>{e(title)}</title></line>")
    out.append(f"<line x1='{left}' x2='{left + PLOT_WIDTH}' y1='{plot_height}' y2='{plot_height}' stroke='#444'/>")
    for t in ticks:
        x = left + t * divisor * scale
        out.append(f"<line x1='{x:.1f}' x2='{x:.1f}' y1='{plot_height}' y2='{plot_height + 4}' stroke='#444'/>"
                   f"<text x='{x:.1f}' y='{plot_height + 16}' text-anchor='middle'>{tick_label(t, ticks[1])}</text>")
    out.append(f"<text class='axis-title' x='{left + PLOT_WIDTH / 2}' y='{plot_height + 34}' text-anchor='middle'>"
               f"{e(chart.x_title)} ({e(unit_name)})</text>")
    out.append(f"<text class='axis-title' x='{left - 6}' y='{TOP - 10}' text-anchor='end'>{e(chart.y_title)}</text>")
    out += keys
    out.append(f"</svg><figcaption>{e(chart.caption)}</figcaption></figure>")
    return "".join(out)


# A chart on a page of its own (the dashboard's iframe), outside report.html and its page style: the text sizes the
# layout assumes (CHAR) and no page margin.
STYLE = ("<style>body{margin:0;font-family:system-ui,sans-serif}figure{margin:0}svg text{font-size:11px}"
         "svg text.axis-title{font-size:12px;font-weight:600}figcaption{font-size:13px;color:#444;margin:4px 0 12px}"
         "</style>")


def stacked(parts: list[tuple[str, float, str]], unit: str, what: str = "") -> list[Segment]:
    """(name, value, color) parts laid end to end from 0, one segment each, with the figure written by
    ledger.present.units as hover title ("name (what): 1.23 ms"); parts that are zero or negative take no room (a
    difference of clocks a few ns below zero is not a term)."""
    out, x = [], 0.0
    for name, value, color in parts:
        if value > 0:
            label = f"{name} ({what})" if what else name
            out.append(Segment(x, value, color, f"{label}: {fmt.value(value, unit)} = {fmt.exact(value, unit)}"))
            x += value
    return out
