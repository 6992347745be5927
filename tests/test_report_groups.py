"""How report.md and report.html group the reconciliation for reading (ledger.present.row_groups) and state caveats once
(ledger.present.caveats), on hand-made rows.

PLUMBING ONLY: the rows below are made up to give each grouping rule a known answer; no figure in them is a claim
about a measurement.
"""
from __future__ import annotations

from typing import Any

from ledger.present.caveats import Notes, clauses
from ledger.present.row_groups import FORMULA, TIME_MODEL, group, predictor

CAVEAT = "8 ranks share host vm's 2 cores: process oversubscription; every timed range includes waits for a core"


def row(metric: str, rank: int | None, *, predicted=None, inventory=None, measured=None, unit="bytes",
        verdict="ok", rel_diff=None, explanation="what the figure is", stage=0, bucket=None,
        source="events", step=None) -> dict[str, Any]:
    return {"metric": metric, "rank": rank, "stage": stage, "bucket": bucket, "step": step, "unit": unit,
            "predicted": predicted, "inventory": inventory, "measured": measured, "verdict": verdict,
            "rel_diff": rel_diff, "explanation": explanation, "source": source}


def test_rows_identical_across_eight_ranks_are_one_line():
    rows = [row("memory.static_after_first_step", r, predicted=1 << 20, inventory=1 << 20) for r in range(8)]
    (line,) = group(rows)
    assert line.ranks == list(range(8))
    assert line.where() == "ranks 0–7 · stage 0 · events"
    assert line.cells()[FORMULA] == "1.00 MiB" and line.cells()["inventory"] == "1.00 MiB"
    assert line.verdict() == "ok" and line.gap() == "—"


def test_a_line_of_several_steps_names_them_all():
    """A profiled window's per-step rows are one line: it names the steps it holds, not the first one alone (the
    report said "step 15" beside the worst row's explanation of step 16)."""
    rows = [row("step.decomposition.host_bound_idle", 0, measured=m, unit="s", source="trace", step=n)
            for n, m in ((15, 7.0e-3), (16, 7.4e-3))]
    (line,) = group(rows)
    assert line.where() == "rank 0 · stage 0 · steps 15, 16 · trace"  # in the words the explanations use
    assert group(rows[:1])[0].where() == "rank 0 · stage 0 · step 15 · trace"


def test_a_line_shows_the_range_the_worst_verdict_and_the_rank_that_has_it():
    rows = [row("pipeline.bubble_of_wall_time", r, predicted=0.2, measured=m, unit="fraction", verdict=v,
                rel_diff=(m - 0.2) / 0.2, explanation=f"rank {r}'s own words", source="timers")
            for r, m, v in ((0, 0.21, "ok"), (1, 0.5, "off"), (2, 0.3, "warn"), (3, 0.6, "off"))]
    (line,) = group(rows)
    assert line.cells()["measured"] == "21.00%–60.00%"
    assert line.verdict() == "off"
    assert [j.text() for j in line.judgements()] == ["off 2/4"]
    assert line.worst()["rank"] == 3 and line.gap() == "+200% (rank 3)"  # the largest gap among the off rows
    assert line.explanation() == "rank 3's own words"


def test_rows_of_other_buckets_or_sources_are_other_lines():
    rows = [row("overlap.reduce_scatter.comm_time", r, bucket=b, source=s, unit="s", measured=1e-3)
            for r in range(2) for b in (0, 1) for s in ("timers", "trace")]
    assert [(line.rows[0]["bucket"], line.rows[0]["source"], line.ranks) for line in group(rows)] == [
        (0, "timers", [0, 1]), (0, "trace", [0, 1]), (1, "timers", [0, 1]), (1, "trace", [0, 1])]


def test_textbook_and_time_model_twins_share_a_line():
    rows = []
    for r, model in ((0, 0.15), (1, 0.17)):
        rows.append(row("pipeline.bubble_of_wall_time", r, predicted=1 / 9, measured=0.16, unit="fraction",
                        verdict="off", rel_diff=0.44, explanation="textbook: (p-1)/(m+p-1)", source="timers"))
        rows.append(row("pipeline.bubble_of_wall_time.model", r, predicted=model, measured=0.16, unit="fraction",
                        verdict="ok", rel_diff=0.16 / model - 1, explanation="time model: stage imbalance",
                        source="timers"))
    (line,) = group(rows)
    cells = line.cells()
    assert (cells[FORMULA], cells[TIME_MODEL], cells["measured"]) == ("11.11%", "15.00%–17.00%", "16.00%")
    assert [j.text() for j in line.judgements()] == ["time model ok", "formula off"]
    assert line.explanation() == "time model: stage imbalance; textbook: (p-1)/(m+p-1)"


def test_a_time_model_row_without_a_textbook_twin_stands_alone():
    (line,) = group([row("pipeline.bubble_of_wall_time.model", 0, predicted=0.1, unit="fraction")])
    assert line.metric == "pipeline.bubble_of_wall_time.model" and line.predictions() == {TIME_MODEL: [0.1]}


def test_each_prediction_goes_to_the_column_of_what_made_it():
    assert predictor("memory.peak_allocated") == FORMULA
    assert predictor("time.forward_per_microbatch") == TIME_MODEL
    assert predictor("throughput.step_time") == TIME_MODEL
    assert predictor("overlap.all_gather.exposed_time") == TIME_MODEL
    assert predictor("overlap.reduce_scatter.overlapped_fraction") == FORMULA
    assert predictor("throughput.step_time_vs_other_ranks") == "reference"
    # the step decomposition's terms are judged against the time model's twin of the step, not a formula
    assert predictor("step.decomposition.host_bound_idle") == TIME_MODEL
    assert predictor("step.decomposition.exposed_communication.tp") == TIME_MODEL


def test_clauses_split_outside_parentheses_only():
    assert clauses("a (b; c); d; e [f; g]") == ["a (b; c)", "d", "e [f; g]"]


def test_a_caveat_many_lines_repeat_becomes_one_note_cited_by_number():
    explanations = [f"figure {i}; {CAVEAT}" for i in range(5)] + ["figure 5", f"figure 6; short; {CAVEAT}"]
    notes = Notes.of(explanations)
    assert notes.texts == [CAVEAT] and notes.cited_by == [6]  # the caveat's own "; " does not split it in two
    assert notes.cite(explanations[0]).inline() == "figure 0 [1]"
    assert notes.cite(explanations[6]).inline() == "figure 6; short [1]"
    assert notes.cite("figure 5").inline() == "figure 5"


def test_the_first_clause_and_rare_or_short_clauses_stay_inline():
    first = "a first clause long enough to be a note of its own"
    explanations = [f"{first}; x"] * 3 + ["b; too short to cite"] * 3 + ["c; a clause only two lines carry here"] * 2
    notes = Notes.of(explanations)
    assert notes.texts == []
    assert notes.cite(explanations[0]).inline() == explanations[0]
