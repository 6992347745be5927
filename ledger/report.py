"""RUN/ledger/report.md and a self-contained report.html (inline CSS and SVG, no external assets: it opens
offline and survives being mailed around). Both are rendered from the reconciliation and the loaders' views, so
the report shows nothing the ledger did not compute.
"""
from __future__ import annotations

import html
from pathlib import Path
from typing import Any

from common.run_dir import atomic_write_text
from ledger import loaders
from ledger.headline import HEADLINES, figure, rows_of, verdict
from ledger.reconcile.run import LEDGER_DIR

COLORS = {"ok": "#2e7d32", "warn": "#ef6c00", "off": "#c62828", "n/a": "#757575", "identity": "#5c6bc0",
          "forward": "#1e88e5", "backward": "#8e24aa", "overlapped": "#43a047", "exposed": "#e53935"}
TERM_COLORS = ("#1e88e5", "#8e24aa", "#fb8c00", "#6d4c41")
NSYS_NOTE = ("Nsight Systems: the probes emit NVTX ranges (--nvtx) and bracket the profiler window with "
             "cudaProfilerStart/Stop (--nsys-profile); capture per rank with `nsys profile --trace=cuda,nvtx,nccl "
             "--capture-range=cudaProfilerApi --capture-range-end=stop -o RUN/nsys/rank%q{RANK} train-ledger train "
             "... --nvtx --nsys-profile --profile-step-start A --profile-step-end B`.")


def build(run_dir: str) -> dict[str, Any]:
    """Everything both renderings need, gathered once."""
    data = loaders.load_reconciliation(run_dir)
    return {"data": data, "waterfall": loaders.memory_waterfall(run_dir),
            "timeline": loaders.stage_timeline(run_dir), "buckets": loaders.bucket_intervals(run_dir),
            "topology": loaders.topology(run_dir)}


def write(run_dir: str, out: Path | None = None) -> tuple[Path, Path]:
    """report.md and report.html into `out` (default RUN/ledger)."""
    view = build(run_dir)
    out = out if out is not None else Path(run_dir) / LEDGER_DIR
    md, page = out / "report.md", out / "report.html"
    markdown, html_text = render_markdown(view), render_html(view)
    atomic_write_text(md, markdown)
    atomic_write_text(page, html_text)
    return md, page


def fmt(value: Any, unit: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and unit in ("fraction", "ratio", "x mean"):
        return f"{value:.3f}"
    if unit == "bytes":
        return f"{value / 2**20:,.2f} MiB" if abs(value) >= 2**20 else f"{value:,.0f} B"
    if unit == "s":
        return f"{value * 1e3:.3f} ms"
    return f"{value:,.4g}" if isinstance(value, float) else str(value)


def headline(rows: list[dict[str, Any]]) -> list[tuple[str, dict[str, Any], str]]:
    """(label, figure, verdict) of every headline (ledger.headline), as the demo and the dashboard show them."""
    return [(h.label, figure(rows, h), verdict(rows_of(rows, h))) for h in HEADLINES]


def _where(row: dict[str, Any]) -> str:
    return " ".join(f"{k} {row[k]}" for k in ("rank", "stage", "bucket", "step") if row.get(k) is not None) or "run"


# --- markdown -------------------------------------------------------------------------------------------------
def render_markdown(view: dict[str, Any]) -> str:
    data = view["data"]
    run = data["run"]
    lines = [f"# Reconciliation of run {run['run_id']}", "",
             f"{run['framework']}, status {run['status']}, world size {run['world_size']}. Verdicts: "
             + ", ".join(f"{n} {k}" for k, n in data["verdicts"].items()) + ".", ""]
    lines += ["## Headline", "", "| figure | value | verdict | from |", "|---|---|---|---|"]
    for label, fig, judged in headline(data["rows"]):
        lines.append(f"| {label} | {fmt(fig['value'], fig['unit'])} | {judged} | {fig['source']} |")
    lines.append("")
    if data["missing"]:
        lines += ["## Missing", ""] + [f"- {m}" for m in data["missing"]] + [""]
    for section, rows in sections(data["rows"]).items():
        lines += [f"## {section}", "", "| metric | where | predicted | inventory | measured | unit | diff | verdict "
                  "| explanation |", "|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            lines.append(f"| {r['metric']} | {_where(r)} | {fmt(r['predicted'], r['unit'])} | "
                         f"{fmt(r['inventory'], r['unit'])} | {fmt(r['measured'], r['unit'])} | {r['unit']} | "
                         f"{fmt(r['rel_diff'], 'ratio') if r['rel_diff'] is not None else '-'} | **{r['verdict']}** | "
                         f"{r['explanation'].replace('|', '/')} |")
        lines.append("")
    lines += ["## Memory waterfall (measured; predicted in brackets)", ""]
    for w in view["waterfall"]:
        terms = "; ".join(f"{t['term']} {fmt(t['measured'], 'bytes')} [{fmt(t['predicted'], 'bytes')}]"
                          for t in w["terms"])
        lines.append(f"- rank {w['rank']}: {terms}; NVML used {fmt(w['nvml_used'], 'bytes')}")
    lines += ["", "## Traces", "", "`train-ledger export-trace RUN --out merged.json.gz` merges the per-rank traces "
              "for Perfetto (ui.perfetto.dev) or chrome://tracing.", "", NSYS_NOTE, ""]
    return "\n".join(lines)


def sections(rows: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    names = {"memory": "Memory", "overlap": "DP bucket overlap", "pipeline": "Pipeline", "comm": "Communication volume",
             "throughput": "Throughput"}
    out: dict[str, list[dict[str, Any]]] = {}
    for r in rows:
        out.setdefault(names.get(r["metric"].split(".")[0], "Other"), []).append(r)
    return out


# --- html -----------------------------------------------------------------------------------------------------
def render_html(view: dict[str, Any]) -> str:
    data = view["data"]
    run = data["run"]
    e = html.escape
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>train-ledger {e(str(run['run_id']))}</title>"
             f"<style>{CSS}</style></head><body>",
             f"<h1>Reconciliation of run {e(str(run['run_id']))}</h1>",
             f"<p>{e(str(run['framework']))}, status <b>{e(str(run['status']))}</b>, world size {run['world_size']}. "
             + " ".join(f"<span class='pill' style='background:{COLORS[k]}'>{n} {k}</span>"
                        for k, n in data["verdicts"].items()) + "</p>"]
    parts.append("<h2>Headline</h2><table><tr><th>figure</th><th>value</th><th>verdict</th><th>from</th></tr>"
                 + "".join(f"<tr><td class='l'>{e(label)}</td><td>{e(fmt(fig['value'], fig['unit']))}</td>"
                           f"<td style='color:{COLORS[judged]}'><b>{judged}</b></td>"
                           f"<td class='l'>{e(fig['source'])}</td></tr>"
                           for label, fig, judged in headline(data["rows"])) + "</table>")
    if data["missing"]:
        parts.append("<h2>Missing</h2><ul>" + "".join(f"<li>{e(m)}</li>" for m in data["missing"]) + "</ul>")
    parts.append("<h2>Memory waterfall per rank</h2>" + waterfall_svg(view["waterfall"]))
    parts.append("<h2>Pipeline timeline</h2>" + timeline_svg(view["timeline"], view["topology"]))
    parts.append("<h2>DP bucket overlap</h2>" + buckets_svg(view["buckets"]))
    for section, rows in sections(data["rows"]).items():
        parts.append(f"<h2>{e(section)}</h2>" + rows_table(rows))
    parts.append(f"<h2>Traces</h2><p><code>train-ledger export-trace RUN --out merged.json.gz</code> merges the "
                 f"per-rank traces for Perfetto or chrome://tracing.</p><p>{e(NSYS_NOTE)}</p></body></html>")
    return "\n".join(parts)


CSS = ("body{font-family:system-ui,sans-serif;margin:2em;color:#222}table{border-collapse:collapse;font-size:13px}"
       "td,th{border:1px solid #ccc;padding:3px 6px;text-align:right}td.l{text-align:left}"
       ".pill{color:#fff;border-radius:8px;padding:1px 8px;margin-right:4px}svg text{font-size:11px}")


def rows_table(rows: list[dict[str, Any]]) -> str:
    e = html.escape
    head = ("<table><tr><th>metric</th><th>where</th><th>predicted</th><th>inventory</th><th>measured</th>"
            "<th>rel diff</th><th>verdict</th><th>explanation</th></tr>")
    body = []
    for r in rows:
        rel = f"{r['rel_diff']:+.2%}" if r["rel_diff"] is not None else "-"
        body.append(f"<tr><td class='l'>{e(r['metric'])}</td><td class='l'>{e(_where(r))}</td>"
                    f"<td>{e(fmt(r['predicted'], r['unit']))}</td><td>{e(fmt(r['inventory'], r['unit']))}</td>"
                    f"<td>{e(fmt(r['measured'], r['unit']))}</td><td>{rel}</td>"
                    f"<td style='color:{COLORS[r['verdict']]}'><b>{r['verdict']}</b></td>"
                    f"<td class='l'>{e(r['explanation'])}</td></tr>")
    return head + "".join(body) + "</table>"


def waterfall_svg(waterfall: list[dict[str, Any]]) -> str:
    """One stacked bar per rank: the measured terms left to right, NVML used as a tick."""
    if not waterfall:
        return "<p>No memory rows.</p>"
    totals = [sum(t["measured"] or 0 for t in w["terms"]) for w in waterfall] + [w["nvml_used"] or 0 for w in waterfall]
    scale = 600 / max(max(totals), 1)
    height = 22 * len(waterfall) + 40
    out = [f"<svg width='820' height='{height}' xmlns='http://www.w3.org/2000/svg'>"]
    for i, w in enumerate(waterfall):
        y, x = 10 + 22 * i, 90.0
        out.append(f"<text x='0' y='{y + 13}'>rank {w['rank']}</text>")
        for color, t in zip(TERM_COLORS, w["terms"]):
            width = (t["measured"] or 0) * scale
            out.append(f"<rect x='{x:.1f}' y='{y}' width='{width:.1f}' height='16' fill='{color}'>"
                       f"<title>{html.escape(t['term'])}: {fmt(t['measured'], 'bytes')} (predicted "
                       f"{fmt(t['predicted'], 'bytes')})</title></rect>")
            x += width
        if w["nvml_used"]:
            nx = 90 + w["nvml_used"] * scale
            out.append(f"<line x1='{nx:.1f}' x2='{nx:.1f}' y1='{y - 2}' y2='{y + 18}' stroke='#000' stroke-width='2'>"
                       f"<title>NVML used {fmt(w['nvml_used'], 'bytes')}</title></line>")
    legend_y = 22 * len(waterfall) + 30
    for j, (color, t) in enumerate(zip(TERM_COLORS, waterfall[0]["terms"])):
        out.append(f"<rect x='{90 + 180 * j}' y='{legend_y - 10}' width='10' height='10' fill='{color}'/>"
                   f"<text x='{104 + 180 * j}' y='{legend_y}'>{html.escape(t['term'][:28])}</text>")
    return "".join(out) + "</svg>"


def timeline_svg(slots: list[dict[str, Any]], topo: dict[str, Any]) -> str:
    if not slots:
        return "<p>No timers in this run (--timers).</p>"
    ranks = sorted({s["rank"] for s in slots})
    end = max(s["end"] for s in slots) or 1.0
    scale = 700 / end
    labels = {r["rank"]: r["label"] for r in topo["ranks"]}
    out = [f"<p>Step {slots[0]['step']}, {end * 1e3:.2f} ms from the first forward.</p>",
           f"<svg width='880' height='{20 * len(ranks) + 10}' xmlns='http://www.w3.org/2000/svg'>"]
    for i, rank in enumerate(ranks):
        y = 5 + 20 * i
        out.append(f"<text x='0' y='{y + 12}'>{html.escape(labels.get(rank, str(rank)))}</text>")
        for s in (s for s in slots if s["rank"] == rank):
            x, width = 170 + s["start"] * scale, max((s["end"] - s["start"]) * scale, 0.5)
            out.append(f"<rect x='{x:.1f}' y='{y}' width='{width:.1f}' height='15' fill='{COLORS[s['kind']]}' "
                       f"stroke='#fff' stroke-width='0.5'><title>{s['kind']} mb{s['microbatch']}: "
                       f"{(s['end'] - s['start']) * 1e3:.3f} ms</title></rect>")
    return "".join(out) + "</svg>"


def buckets_svg(intervals: list[dict[str, Any]]) -> str:
    """Per rank and bucket (last step): the collective's interval split into overlapped and exposed time."""
    if not intervals:
        return "<p>No DP bucket timers in this run.</p>"
    last = max(i["step"] for i in intervals)
    chosen = sorted((i for i in intervals if i["step"] == last), key=lambda i: (i["rank"], i["op"], i["bucket"]))
    widest = max(i["end"] - i["start"] for i in chosen) or 1.0
    scale = 500 / widest
    out = [f"<p>Step {last}: green = under compute, red = exposed.</p>",
           f"<svg width='760' height='{18 * len(chosen) + 10}' xmlns='http://www.w3.org/2000/svg'>"]
    for k, i in enumerate(chosen):
        y = 5 + 18 * k
        out.append(f"<text x='0' y='{y + 11}'>rank {i['rank']} {i['op']} b{i['bucket']}</text>")
        w_over, w_exp = i["overlapped"] * scale, i["exposed"] * scale
        out.append(f"<rect x='200' y='{y}' width='{w_over:.1f}' height='13' fill='{COLORS['overlapped']}'/>"
                   f"<rect x='{200 + w_over:.1f}' y='{y}' width='{w_exp:.1f}' height='13' fill='{COLORS['exposed']}'>"
                   f"<title>{(i['end'] - i['start']) * 1e3:.3f} ms, exposed {i['exposed'] * 1e3:.3f} ms</title></rect>")
    return "".join(out) + "</svg>"
