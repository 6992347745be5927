"""A Megatron-LM run directory (the layout runs/megatron/run.sh writes) reconciles through the same rows."""
from __future__ import annotations

import json
import os
import subprocess
import textwrap
from pathlib import Path

import pytest

from ledger.reconcile.run import reconcile

REPO = Path(__file__).resolve().parent.parent

# A stand-in for Megatron-LM's pretrain_gpt.py: what the real one leaves in --tensorboard-dir with
# --log-memory-to-tensorboard --log-timers-to-tensorboard --profile --use-pytorch-profiler.
FAKE_PRETRAIN = textwrap.dedent('''
    import json, os, sys
    args = sys.argv[1:]
    tb = args[args.index("--tensorboard-dir") + 1]
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    trace = {"distributedInfo": {"backend": "nccl", "rank": rank, "world_size": world}, "traceEvents": [
        {"ph": "X", "cat": "user_annotation", "name": "ProfilerStep#%d" % s, "pid": 1, "tid": 1, "ts": s * 1000.0,
         "dur": 900.0} for s in (20, 21)]}
    with open(os.path.join(tb, "host_%d.123.pt.trace.json" % (1000 + rank)), "w") as f:
        json.dump(trace, f)
    if rank == world - 1:
        from torch.utils.tensorboard import SummaryWriter
        w = SummaryWriter(tb)
        for step in range(1, 4):
            w.add_scalar("mem-reserved-bytes", 30e9 + step * 1e6, step)
            w.add_scalar("mem-allocated-bytes", 10e9, step)
            w.add_scalar("mem-max-allocated-bytes", 20e9 + step * 1e6, step)
            w.add_scalar("iteration-time", 1.5, step)
        w.close()
''')


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    checkout = root / "Megatron-LM"
    checkout.mkdir()
    (checkout / "pretrain_gpt.py").write_text(FAKE_PRETRAIN)
    run = root / "run"
    env = dict(os.environ, MEGATRON_LM=str(checkout), NPROC="8")
    done = subprocess.run(["bash", str(REPO / "runs/megatron/run.sh"), str(run)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return run


def test_run_sh_writes_the_ingest_layout(megatron_run):
    meta = json.loads((megatron_run / "megatron_run.json").read_text())
    assert meta["framework"] == "megatron-lm" and meta["world_size"] == 8 and meta["exit_code"] == 0
    assert "--log-memory-to-tensorboard" in meta["argv"] and (megatron_run / "logs/torchrun.log").is_file()
    assert len(list((megatron_run / "tb").glob("*.pt.trace.json"))) == 8


def test_megatron_run_reconciles(megatron_run):
    result = reconcile(megatron_run)
    assert result.run["framework"] == "megatron-lm" and result.run["status"] == "complete"
    peak = [r for r in result.rows if r.metric == "memory.peak_allocated"]
    # TensorBoard stores scalars as float32: byte counts survive to about 7 significant digits
    assert [(r.rank, r.stage, pytest.approx(r.measured, rel=1e-6)) for r in peak] == [(7, 1, 20e9 + 3e6)]
    assert peak[0].predicted is not None  # the llama3.2-1b TP2 PP2 DP2 plan from Megatron's own flags
    frag = next(r for r in result.rows if r.metric == "memory.fragmentation")
    assert frag.measured == pytest.approx(10e9, rel=1e-6)  # reserved - peak of step 3, where reserved peaked
    assert any(r.metric == "throughput.tokens_per_step" and r.measured == 16 * 8192 for r in result.rows)
    assert any("Megatron-LM run" in m for m in result.missing)
    assert any("--profile" in m for m in result.missing)  # flags the formulas do not model are named
    assert len(result.run["traces"]) == 8
