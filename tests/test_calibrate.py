"""`train-ledger calibrate` times this machine's kernels of a configuration alone, and `reconcile --calibration`
prices a run that made no sweep (a Megatron-LM run) from that file."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.cli import run as run_cli

FIXTURE_FLAGS = ("--num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 "
                 "--group-query-attention --num-query-groups 2 --seq-length 32 --max-position-embeddings 32 "
                 "--position-embedding-type rope --swiglu --normalization RMSNorm --disable-bias-linear "
                 "--attention-dropout 0 --hidden-dropout 0 --transformer-impl local --no-gradient-accumulation-fusion "
                 "--no-masked-softmax-fusion --no-bias-swiglu-fusion --no-rope-fusion --micro-batch-size 2 "
                 "--global-batch-size 4 --bf16 --vocab-size 128 --tokenizer-type NullTokenizer --mock-data")


@pytest.mark.slow
def test_calibrate_sweeps_megatrons_own_kernels_and_says_what_it_did_not(tmp_path: Path):
    """Megatron-LM's local implementation: the unfused attention's softmax and batched GEMMs, the unfused RoPE and
    SwiGLU, the fp32 loss and torch's foreach AdamW are timed beside the shared kernels, and the host sweep's
    primitives (megatron_host_recipe.py prices its local layers' calls with them); the bandwidth sweep (no group in
    one process) is named as not swept."""
    out = tmp_path / "cal.jsonl"
    code, stdout, err = run_cli(["calibrate", "--out", str(out), "--megatron-args", FIXTURE_FLAGS])
    assert code == 0, err
    header, *records = [json.loads(line) for line in out.read_text().splitlines()]
    assert header["calibration"] == 1 and header["implementation"] == "local"
    assert any("bandwidth" in n for n in header["not_swept"]) and "not swept: bandwidth" in stdout
    ops = {r["op"] for r in records}
    assert {"core_attention.softmax.fwd", "core_attention.softmax.bwd", "core_attention.scores.fprop",
            "rope_unfused.fwd", "swiglu_unfused.bwd", "cross_entropy_fp32.fwd", "optimizer.step_foreach",
            "attention.repeat_kv.fwd"} <= ops
    assert "core_attention.fwd" not in ops and "swiglu.fwd" not in ops  # flash attention and fused SwiGLU don't run
    compute = [r for r in records if r["kind"] == "compute"]
    host = [r for r in records if r["kind"] == "host"]
    assert len(compute) + len(host) == len(records) and all(r["seconds"] > 0 for r in compute)
    assert {"eager", "view", "module", "autograd_node"} <= {r["op"] for r in host}  # what a CPU host can time


def test_a_calibration_file_is_checked_line_by_line(tmp_path: Path):
    bad = tmp_path / "cal.jsonl"
    bad.write_text('{"calibration": 1}\n{"kind": "compute", "op": "x", "seconds": "fast"}\n')
    code, _, err = run_cli(["reconcile", str(Path(__file__).parent / "fixtures/megatron_lm_1gpu"), "--out",
                            str(tmp_path / "ledger"), "--calibration", str(bad)])
    assert code == 2 and err.count("\n") == 1 and "cal.jsonl: line 2" in err
