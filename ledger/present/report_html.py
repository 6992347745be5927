"""report.html: the report of ledger.present.report_view as one self-contained page (inline CSS and SVG, no external
assets).

Same content as report.md (headline, missing evidence, notes, what is off, one line per figure), plus three
charts (ledger.present.charts): the memory terms per rank, the pipeline timeline of one step and the DP buckets'
collectives, each with labelled axes and a caption, or a sentence saying why it is empty. Byte figures carry their
exact count as a hover title.
"""
from __future__ import annotations

import html
from typing import Any

from ledger.present import units
from ledger.present.charts import Bar, Chart, Segment, empty, render
from ledger.present.report_view import (
    COLUMN_TITLES,
    NSYS_NOTE,
    OFF_POINTER,
    View,
    columns,
    headline,
    off_item,
    off_list,
    sections,
    summary,
    unmeasured_memory,
)
from ledger.present.row_groups import Line
from ledger.present.step_table import CLASS_INTRO, INTRO, StepTable, class_table, step_table

COLORS = {"ok": "#2e7d32", "warn": "#ef6c00", "off": "#c62828", "n/a": "#757575", "identity": "#5c6bc0",
          "forward": "#1e88e5", "backward": "#8e24aa", "overlapped": "#43a047", "exposed": "#e53935"}
TERM_COLORS = ("#1e88e5", "#8e24aa", "#fb8c00", "#6d4c41")
CSS = ("body{font-family:system-ui,sans-serif;margin:2em;color:#222;max-width:1300px}"
       "table{border-collapse:collapse;font-size:13px}td,th{border:1px solid #ccc;padding:3px 6px;text-align:right;"
       "vertical-align:top;white-space:nowrap}td.l,th.l{text-align:left;white-space:normal}td.w{white-space:nowrap}"
       ".pill{color:#fff;border-radius:8px;padding:1px 8px;margin-right:4px}svg text{font-size:11px}"
       "svg text.axis-title{font-size:12px;font-weight:600}"
       "figcaption{font-size:13px;color:#444;margin:4px 0 12px}.empty{color:#555;background:#f5f5f5;"
       "padding:8px;border-left:4px solid #bbb}.off{border-left:4px solid #c62828;background:#fdecea;"
       "padding:6px 10px;margin:6px 0}ol.notes li{margin:3px 0}")
e = html.escape


def cell(values: list[float | None], unit: str, text: str) -> str:
    """A table cell; bytes carry the exact count(s) as hover title."""
    present = [v for v in values if v is not None]
    if unit == "bytes" and present:
        exact = " – ".join(dict.fromkeys(units.exact(v, unit) for v in (min(present), max(present))))
        return f"<td title='{e(exact)}'>{e(text)}</td>"
    return f"<td>{e(text)}</td>"


def render_html(view: View) -> str:
    data = view.data
    run = data["run"]
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>train-ledger {e(str(run['run_id']))}</title>"
             f"<style>{CSS}</style></head><body>",
             f"<h1>Reconciliation of run {e(str(run['run_id']))}</h1>",
             "<p>" + " ".join(f"<span class='pill' style='background:{COLORS[k]}'>{n} {k}</span>"
                              for k, n in data["verdicts"].items()) + f"</p><p>{e(summary(data, view.lines))}</p>"]
    parts.append("<h2>Headline</h2><table><tr><th class='l'>figure</th><th>value</th><th>verdict</th>"
                 "<th class='l'>from</th></tr>"
                 + "".join(f"<tr><td class='l'>{e(label)}</td>"
                           + cell([fig["value"]], fig["unit"], units.value(fig["value"], fig["unit"]))
                           + f"<td style='color:{COLORS[judged]}'><b>{judged}</b></td>"
                           f"<td class='l'>{e(fig['source'])}</td></tr>"
                           for label, fig, judged in headline(data["rows"])) + "</table>")
    if data["missing"]:
        parts.append("<h2>Missing</h2><ul>" + "".join(f"<li>{e(units.plain(m))}</li>" for m in data["missing"])
                     + "</ul>")
    if view.notes.texts:
        parts.append("<h2>Notes</h2><p>Caveats that many rows share, stated once; lines cite them as [n].</p>"
                     "<ol class='notes'>" + "".join(f"<li>{e(units.plain(t))} ({n} line{'s' if n > 1 else ''})</li>"
                                                    for t, n in zip(view.notes.texts, view.notes.cited_by)) + "</ol>")
    off = off_list(view)
    if off.items:
        parts.append("<h2>What is off</h2>" + (f"<p>{e(off.head())}</p>" if off.shared else "")
                     + "".join(f"<div class='off'><b>{e(line.metric)}</b> {e(off_item(line, text))}</div>"
                               for line, text in off.items))
    parts.append("<h2>Memory per rank</h2>" + memory_chart(view))
    parts.append("<h2>Pipeline timeline</h2>" + timeline_chart(view.timeline, view.topology))
    parts.append("<h2>DP bucket overlap</h2>" + buckets_chart(view.buckets))
    for section, members in sections(view.lines).items():
        parts.append(f"<h2>{e(section)}</h2>" + lines_table(view, members))
    parts.append(step_section(data["rows"]))
    parts.append(f"<h2>Traces</h2><p><code>train-ledger export-trace RUN --out merged.json.gz</code> merges the "
                 f"per-rank traces for Perfetto or chrome://tracing.</p><p>{e(NSYS_NOTE)}</p></body></html>")
    return "\n".join(parts)


def lines_table(view: View, members: list[Line]) -> str:
    shown = columns(members)
    head = ("<table><tr><th class='l'>metric</th><th class='l'>ranks</th>"
            + "".join(f"<th>{COLUMN_TITLES[c]}</th>" for c in shown)
            + "<th>gap (worst)</th><th class='l'>verdict</th><th class='l'>explanation</th></tr>")
    body = []
    for line in members:
        cells = line.cells()
        values = {c: [r["predicted"] for r in line.all_rows()] if c not in ("inventory", "measured")
                  else [r[c] for r in line.rows] for c in shown}
        verdicts = " · ".join(f"<b style='color:{COLORS[j.verdict]}'>{e(j.text())}</b>" for j in line.judgements())
        why = OFF_POINTER if line.verdict() == "off" else view.explanation(line)
        body.append(f"<tr><td class='l'>{e(line.metric)}</td><td class='l w'>{e(line.where())}</td>"
                    + "".join(cell(values[c], line.unit, cells[c]) for c in shown)
                    + f"<td>{e(line.gap())}</td><td class='l'>{verdicts}</td><td class='l'>{e(why)}</td></tr>")
    return head + "".join(body) + "</table>"


def step_section(rows: list[dict[str, Any]]) -> str:
    """Where the step went: per rank and profiled step, the decomposition's terms, their sum and the replay."""
    table = step_table(rows)
    if table is None:
        return ""
    classes = class_table(rows)
    return (f"<h2>Where the step went</h2><p>{e(INTRO)}</p>{_html_table(table)}<ul>"
            + "".join(f"<li>{e(p)}</li>" for p in table.paths) + "</ul>"
            + (f"<h3>Device compute by class</h3><p>{e(CLASS_INTRO)}</p>{_html_table(classes)}" if classes else ""))


def _html_table(table: StepTable) -> str:
    head = "".join(f"<th>{e(h)}</th>" for h in table.head)
    body = "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in cells) + "</tr>" for cells in table.body)
    return f"<table><tr>{head}</tr>{body}</table>"


# --- charts ---------------------------------------------------------------------------------------------------
def memory_chart(view: View) -> str:
    """Per rank, the measured terms stacked (with NVML's device total as a tick) and the predicted ones beneath;
    only the predicted bars, said so, when nothing was measured."""
    waterfall = view.waterfall
    if not waterfall:
        return empty("Memory per rank", "the reconciliation has no per-rank memory rows (no rank wrote events, or "
                                        "the manifest has no config)")
    why = unmeasured_memory(view)
    bars = []
    for w in waterfall:
        for column in (("predicted",) if why else ("measured", "predicted")):
            bars.append(Bar(f"rank {w['rank']} {column}", _stack(w["terms"], column),
                            [(w["nvml_used"], f"NVML used {units.exact(w['nvml_used'], 'bytes')}")]
                            if column == "measured" and w["nvml_used"] else []))
    if not any(b.segments for b in bars):
        return empty("Memory per rank", "no rank has a measured or predicted memory term")
    caption = ("What to look for: the measured bar against the predicted one beneath it; 'reserved beyond peak' "
               "and 'outside PyTorch' are memory no formula predicts; the black tick is NVML's device total.")
    if why:
        caption = (f"Nothing measured ({view.refer(why)}): the bars are the formulas' predictions, static state then "
                   "the activations of the micro-batches in flight; what to look for is how the stages differ.")
    names = [t["term"] for t in waterfall[0]["terms"]]
    return render(Chart(bars, "bytes", "bytes per rank", "rank", list(zip(TERM_COLORS, names)), caption))


def _stack(terms: list[dict[str, Any]], column: str) -> list[Segment]:
    out, x = [], 0.0
    for color, t in zip(TERM_COLORS, terms):
        value = t[column]
        if value:
            out.append(Segment(x, value, color, f"{t['term']} ({column}): {units.size(value)} = "
                                                f"{units.exact(value, 'bytes')}"))
            x += value
    return out


def timeline_chart(slots: list[dict[str, Any]], topo: dict[str, Any]) -> str:
    if not slots:
        return empty("Pipeline timeline", "no forward / backward timers in this run (record them with --timers)")
    labels = {r["rank"]: r["label"] for r in topo["ranks"]}
    bars = [Bar(labels.get(rank, f"rank {rank}"),
                [Segment(s["start"], s["end"] - s["start"], COLORS[s["kind"]],
                         f"{s['kind']} of micro-batch {s['microbatch']}: {units.duration(s['end'] - s['start'])}, "
                         f"from {units.duration(s['start'])}") for s in slots if s["rank"] == rank])
            for rank in sorted({s["rank"] for s in slots})]
    caption = (f"Step {slots[0]['step']}, each pipeline from its first forward: what to look for is the idle time "
               "between bars (the pipeline bubble) at the start of the later stages and the end of the earlier "
               "ones; the bubble rows below put a number on it.")
    return render(Chart(bars, "s", "time from the pipeline's first forward", "rank (coordinates)",
                        [(COLORS["forward"], "forward"), (COLORS["backward"], "backward")], caption))


def buckets_chart(intervals: list[dict[str, Any]]) -> str:
    """Per rank and bucket (last step): the collective's duration split into overlapped and exposed time."""
    if not intervals:
        return empty("DP bucket overlap", "no DP bucket timers in this run (buckets exist with DP > 1; they are "
                                          "timed with --timers)")
    last = max(i["step"] for i in intervals)
    chosen = sorted((i for i in intervals if i["step"] == last), key=lambda i: (i["rank"], i["op"], i["bucket"]))
    bars = [Bar(f"rank {i['rank']} {i['op']} bucket {i['bucket']}", [
        Segment(0.0, i["overlapped"], COLORS["overlapped"], f"beside compute {units.duration(i['overlapped'])}"),
        Segment(i["overlapped"], i["exposed"], COLORS["exposed"], f"exposed {units.duration(i['exposed'])}")])
        for i in chosen]
    caption = (f"Step {last}, each bucket's collective from issue to wait returned (timers: an upper bound): green "
               "ran beside compute, red was exposed. What to look for: long red bars, the communication overlap "
               "did not hide and the step waited for.")
    return render(Chart(bars, "s", "duration of the collective", "rank, collective, bucket",
                        [(COLORS["overlapped"], "beside compute"), (COLORS["exposed"], "exposed")], caption))
