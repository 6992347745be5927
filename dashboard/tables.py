"""Tables that fit the page: every table of the dashboard is drawn by `table`, which gives each column a width from
its content so that the whole table fits the main column of a 1400 px wide window (MAIN_PX), rather than letting
Streamlit's data grid run wider and cut off the right-hand columns behind a scroll bar.

A column of long text (an explanation, `wide`) takes the width the others leave; its cells are cut short in the
grid, and the page writes each one in full beside the table (the row's explanation box, a list under the table).
"""
from __future__ import annotations

from typing import Any

import pandas as pd
import streamlit as st

MAIN_PX = 920  # the main column at a 1400 px window with the sidebar open (938 px), less the grid's borders
CHAR_PX = 7.5  # the grid's 14 px font, per character of an average cell
PAD_PX = 26  # a cell's horizontal padding
MIN_PX, MAX_PX, WIDE_MIN_PX = 48, 300, 160


def column_widths(frame: pd.DataFrame, wide: str | None = None) -> dict[str, int]:
    """Pixels per column: what the longest cell (or the header) needs, within MIN_PX..MAX_PX, shrunk in proportion
    when the table would not fit MAIN_PX; `wide` gets what is left, at least WIDE_MIN_PX."""
    columns = ([frame.index.name or ""] if _shows_index(frame) else []) + list(frame.columns)
    values = {c: frame[c] if c in frame.columns else frame.index.to_series() for c in columns}
    need = {c: min(MAX_PX, max(MIN_PX, round(CHAR_PX * max([len(str(c)), *(len(str(v)) for v in values[c])])
                                                    + PAD_PX)))
            for c in columns if c != wide}
    budget = MAIN_PX - (WIDE_MIN_PX if wide else 0)
    if sum(need.values()) > budget:
        scale = budget / sum(need.values())
        need = {c: max(MIN_PX, int(px * scale)) for c, px in need.items()}
    if wide:
        need[wide] = max(WIDE_MIN_PX, MAIN_PX - sum(need.values()))
    return need


def _shows_index(frame: pd.DataFrame) -> bool:
    return not isinstance(frame.index, pd.RangeIndex)


def table(data: Any, wide: str | None = None, **kwargs: Any) -> None:
    """st.dataframe of `data` (a DataFrame, or its Styler) with column_widths' widths; a RangeIndex is hidden."""
    frame = data.data if hasattr(data, "data") and isinstance(data.data, pd.DataFrame) else data
    widths = column_widths(frame, wide)
    config = {("_index" if c == (frame.index.name or "") and _shows_index(frame) else c): st.column_config.Column(
        width=px) for c, px in widths.items()}
    st.dataframe(data, hide_index=not _shows_index(frame), column_config=config, **kwargs)
