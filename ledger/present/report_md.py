"""report.md: the report of ledger.present.report_view as markdown tables, one per section."""
from __future__ import annotations

import textwrap

from ledger.present import units
from ledger.present.report_view import (
    COLUMN_TITLES,
    NSYS_NOTE,
    OFF_POINTER,
    View,
    columns,
    grouped_by_text,
    headline,
    off_item,
    off_list,
    sections,
    summary,
    unmeasured_memory,
    waterfall_text,
)
from ledger.present.row_groups import Line
from ledger.present.step_table import CLASS_INTRO, INTRO, StepTable, class_table, step_table

WIDTH = 120  # prose and lists are wrapped here, so report.md reads in a terminal or an editor
TABLE_ROW_LIMIT = 300  # a table row longer than this moves its explanation under the table


def _md(text: str) -> str:
    return text.replace("|", "/").replace("\n", " ")


def _wrapped(text: str, first: str = "", indent: str = "") -> list[str]:
    """`text` as lines of at most WIDTH characters (a longer word stays whole), the first after `first`."""
    return textwrap.wrap(text, WIDTH, initial_indent=first, subsequent_indent=indent, break_long_words=False,
                         break_on_hyphens=False) or [first.rstrip()]


def _item(text: str) -> list[str]:
    return _wrapped(text, "- ", "  ")


def render_markdown(view: View) -> str:
    data = view.data
    lines = [f"# Reconciliation of run {data['run']['run_id']}", "", *_wrapped(summary(data, view.lines)), ""]
    lines += ["## Headline", "", "| figure | value | verdict | from |", "|---|---|---|---|"]
    for label, fig, judged in headline(data["rows"]):
        lines.append(f"| {label} | {units.value(fig['value'], fig['unit'])} | {judged} | {fig['source']} |")
    lines.append("")
    if data["missing"]:
        lines += ["## Missing", ""] + [x for m in data["missing"] for x in _item(_md(units.plain(m)))] + [""]
    if view.notes.texts:
        lines += ["## Notes", "", "Caveats that many rows share, stated once; lines cite them as [n].", ""]
        for i, (text, n) in enumerate(zip(view.notes.texts, view.notes.cited_by), 1):
            lines += _wrapped(f"{_md(units.plain(text))} ({n} line{'s' if n > 1 else ''})", f"{i}. ", "   ")
        lines.append("")
    off = off_list(view)
    if off.items:
        lines += ["## What is off", ""]
        if off.shared:
            lines += [off.head(), ""]
        lines += [x for line, text in off.items for x in _item(f"**{line.metric}** {_md(off_item(line, text))}")]
        lines.append("")
    for section, members in sections(view.lines).items():
        lines += [f"## {section}", ""] + markdown_table(view, members) + [""]
    lines += step_section(data["rows"])
    lines += ["## Memory waterfall (measured; predicted in brackets)", ""]
    why = unmeasured_memory(view)
    if not view.waterfall:
        lines.append("No per-rank memory rows (no rank wrote events, or the manifest has no config).")
    elif why:
        lines += [*_wrapped(f"Nothing measured ({_md(view.refer(why))})."), ""]
    per_rank = [(w["rank"], waterfall_text(w, why is None)) for w in view.waterfall]
    lines += [x for ranks, text in grouped_by_text(per_rank)
              for x in _item(f"rank{'s' if len(ranks) > 1 else ''} {units.ranks(ranks)}: {text}")]
    lines += ["", "## Traces", "", *_wrapped("`train-ledger export-trace RUN --out merged.json.gz` merges the "
                                             "per-rank traces for Perfetto (ui.perfetto.dev) or chrome://tracing."),
              "", *_wrapped(NSYS_NOTE), ""]
    return "\n".join(lines)


def markdown_table(view: View, members: list[Line]) -> list[str]:
    """The section's table; an explanation that would make its row longer than TABLE_ROW_LIMIT is written under
    the table instead, wrapped, and its cell points there."""
    shown = columns(members)
    head = ["metric", "ranks", *(COLUMN_TITLES[c] for c in shown), "gap (worst)", "verdict", "explanation"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    below: list[str] = []
    for line in members:
        cells = line.cells()
        verdicts = " · ".join(j.text() for j in line.judgements())
        why = OFF_POINTER if line.verdict() == "off" else _md(view.explanation(line))
        row = [line.metric, line.where(), *(cells[c] for c in shown), line.gap(), f"**{verdicts}**"]
        text = "| " + " | ".join([*row, why]) + " |"
        if len(text) > TABLE_ROW_LIMIT:
            below += _item(f"`{line.metric}` ({line.where()}): {why}")
            text = "| " + " | ".join([*row, "below the table"]) + " |"
        out.append(text)
    return out + ([""] + below if below else [])


def step_section(rows: list[dict]) -> list[str]:
    """## Where the step went: per rank and profiled step, the decomposition's terms, their sum and the replay."""
    table = step_table(rows)
    if table is None:
        return []
    out = ["## Where the step went", "", *_wrapped(INTRO), "", *_md_table(table)]
    out += [""] + [line for path in table.paths for line in _item(_md(path))] + [""]
    classes = class_table(rows)
    if classes is not None:
        out += ["### Device compute by class", "", *_wrapped(CLASS_INTRO), "", *_md_table(classes), ""]
    return out


def _md_table(table: StepTable) -> list[str]:
    return ["| " + " | ".join(cells) + " |" for cells in [table.head, ["---"] * len(table.head), *table.body]]
