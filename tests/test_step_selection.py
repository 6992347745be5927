"""What a figure over steps says it counts (ledger/evidence/steps.py): the steps it counts and the disturbed steps
it leaves out, each once and never both; when every step after the first was profiled, that it counted them, as a
clause of its own (a report's numbered note)."""
from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

from ledger.evidence.steps import FROM_RECORDS, PROFILED_COUNTED, StepSelection, steps_text
from ledger.reconcile.run import reconcile

FIXTURES = Path(__file__).parent / "fixtures"


def test_steps_in_words():
    assert steps_text([2, 3, 4]) == "2-4" and steps_text([2, 7, 8, 9]) == "2, 7-9" and steps_text([3, 5]) == "3, 5"


def test_a_figure_says_what_it_counts_and_what_it_leaves_out():
    s = StepSelection(first=1, profiled=frozenset({3, 4, 5}), after_export=frozenset({6}), source=FROM_RECORDS)
    assert s.counted([2, 7, 8]) == ("steps 2, 7, 8 (profiled steps 3-5 and step 6 after the trace export left out, "
                                    "per the step records' profiled flags)")
    kept, note = s.timed([1, 2, 3, 4, 5, 6, 7])
    assert kept == [2, 7] and note == ""
    short = StepSelection(first=1, profiled=frozenset({2, 3, 4}), after_export=frozenset(), source=FROM_RECORDS)
    kept, note = short.timed([1, 2, 3, 4])  # the demo's four steps: window 2-3 and the profiler's extra step 4
    assert (kept, note) == ([2, 3, 4], PROFILED_COUNTED)
    assert short.counted(kept) == "steps 2-4"  # nothing it counts is said to be left out
    # a generator of steps, as the data-wait row passes them, names them too ("mean over  (profiled ...)" before)
    assert s.counted(n for n in (2, 7, 8)) == s.counted([2, 7, 8])


def _counted_and_left_out(text: str) -> tuple[set[int], set[int]]:
    def numbers(words: str) -> set[int]:
        out: set[int] = set()
        for a, b in re.findall(r"(\d+)(?:-(\d+))?", words):
            out |= set(range(int(a), int(b or a) + 1))
        return out
    m = re.search(r"over \d+ rank-steps, steps? ([\d, -]+?)(?: \((.*) left out|$)", text)
    return numbers(m.group(1)), numbers(m.group(2) or "")


def test_tokens_per_s_on_a_real_run_counts_its_steady_steps_only(tmp_path):
    """gloo_dp2_overlap: 9 steps, the profiler on 3-5 (window 3-4 and its extra step), step 6 after the export."""
    run = tmp_path / "run"
    shutil.copytree(FIXTURES / "gloo_dp2_overlap", run)
    records = [json.loads(line) for line in (run / "ranks/rank0/events.jsonl").read_text().splitlines()
               if '"kind":"step"' in line]
    disturbed = {r["step"] for r in records if r.get("profiled") or r.get("after_trace_export")}
    steady = {r["step"] for r in records} - disturbed - {min(r["step"] for r in records)}
    (tokens,) = [r for r in reconcile(run).rows if r.metric == "throughput.tokens_per_s"]
    counted, left_out = _counted_and_left_out(tokens.explanation)
    assert counted == steady and left_out == disturbed and not counted & left_out, tokens.explanation


def test_the_demo_announces_every_step_the_profiler_records():
    from cli.demo import profiled_steps

    assert profiled_steps(4) == ("the profiler window is steps 2-3 on every rank (it records step 4 too, which HTA "
                                 "drops: steps 2-4 are profiled)")
    assert profiled_steps(3) == "the profiler window is steps 2-3 on every rank"
