"""`train-ledger buffer` prints the toy's figures (docs/buffer_layout.md) and --json parses."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

import cli.main as cli


@pytest.mark.slow
def test_buffer_prints_the_toy_layout_boundary_and_match():
    done = subprocess.run([sys.executable, "-m", "cli.main", "buffer"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert "numel=22 pad=0" in lines
    assert any(line.startswith("WL: [0, 12), W2: [12, 16), W1: [16, 22)") for line in lines)
    assert "shard boundary=11: WL elements 0..10 on rank0, element 11 on rank1" in lines
    assert "rank0 owns buffer [0, 11): WL[0:11]" in lines
    assert "rank1 owns buffer [11, 22): WL[11:12] W2[0:4] W1[0:6]" in lines
    assert lines[-1] == "matches single-process Adam: True"


@pytest.mark.slow
def test_buffer_json_is_one_object_with_the_toy_figures(capsys):
    assert cli.main(["buffer", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["numel"], r["pad"], r["boundary"]) == (22, 0, 11)
    assert r["ranges"] == {"WL": [0, 12], "W2": [12, 16], "W1": [16, 22]}
    assert r["owned"]["rank0"] == {"range": [0, 11], "elements": {"WL": [0, 11]}}
    assert r["owned"]["rank1"] == {"range": [11, 22], "elements": {"WL": [11, 12], "W2": [0, 4], "W1": [0, 6]}}
    # Megatron's alignment: W2 at 64, W1 at 128..134, bucket end ceil(134 / lcm(2, 128)) * 128 = 256.
    assert r["megatron_aligned"] == {"numel": 256, "pad": 256 - 22}
    assert [[s["adam_elements"] for s in step] for step in r["steps"]] == [[11, 11], [11, 11]]
    for step in r["steps"]:  # after the all-gather both ranks hold the same full parameters
        assert step[0]["param_data_sum"] == step[1]["param_data_sum"]
    assert r["matches"] is True and r["max_abs_diff"] <= r["tolerance"] == 1e-6


def test_buffer_rejects_unknown_flags_with_one_line(capsys):
    assert cli.main(["buffer", "--world-size", "4"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--world-size" in err[0]
