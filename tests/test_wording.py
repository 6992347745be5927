"""Counts in words (common/wording.py): one of a thing is singular, in every command's text."""
from __future__ import annotations

from cli.main import main as cli
from common.wording import plural


def test_plural_is_singular_for_one_only():
    assert [plural(n, "call") for n in (0, 1, 2, 2048)] == ["0 calls", "1 call", "2 calls", "2,048 calls"]
    assert plural(1, "micro-batch") == "1 micro-batch" and plural(8, "micro-batch") == "8 micro-batches"


def test_plan_of_one_micro_batch_says_so(capsys):
    """One rank, micro-batch 1, global batch 1: one micro-batch per step (global / (micro x dp) = 1)."""
    assert cli(["plan", "--model", "tiny", "--world-size", "1", "--micro-batch-size", "1",
                "--global-batch-size", "1"]) == 0
    out = capsys.readouterr().out
    assert "m = 1 micro-batch per DP replica" in out and "1 micro-batches" not in out and " 1 calls" not in out
