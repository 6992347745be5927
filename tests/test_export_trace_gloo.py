"""export-trace on a real 2-rank CPU (gloo) run with both ranks traced: gloo records no process group, so before the
ledger named the groups (ledger.evidence.trace_groups) the ranks shared no collective and were left unaligned. Both
ranks run on this host, one clock: the true offset is 0, which the alignment must find."""
from __future__ import annotations

import subprocess
import sys

import pytest

from cli.main import main as cli
from common.run_dir import iter_events

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dp2_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("gloo_dp2") / "run"
    argv = [sys.executable, "-m", "cli.main", "train", "--nproc-per-node", "2", "--model", "tiny", "--num-layers", "2",
            "--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
            "--ddp-bucket-size", "40000", "--global-batch-size", "4", "--micro-batch-size", "1", "--train-iters", "4",
            "--timers", "--use-pytorch-profiler", "--profile-step-start", "2", "--profile-step-end", "3",
            "--profile-ranks", "0", "1", "--run-dir", str(run)]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return run


def test_both_gloo_ranks_are_aligned_on_their_dp_collectives(dp2_run, tmp_path, capsys):
    assert cli(["export-trace", str(dp2_run), "--out", str(tmp_path / "m.json.gz")]) == 0
    lines = capsys.readouterr().out.splitlines()
    (grad_buffer,) = [t for t in iter_events(dp2_run, 0, {"inventory"}) if t.tensor_kind == "grad_buffer"]
    buckets = len(grad_buffer.buckets)
    # Traced steps 2, 3 and the one more HTA needs; each reduce-scatters and all-gathers every bucket and all-reduces
    # two fp32 scalars over DP (the loss and the grad norm; the grad norm's model-parallel group is the rank alone,
    # and a group of one issues no collective).
    n, scalars = 3 * buckets, 3 * 2
    (line,) = [x for x in lines if x.startswith("rank 1: ") and " µs, " in x]
    offset, rest = line[len("rank 1: "):].split(" µs, ")
    assert rest == (f"from rank 0 over {2 * n + scalars} shared collectives (dp all_gather {n}, dp all_reduce "
                    f"{scalars}, dp reduce_scatter {n})")
    # one host, one clock: the median of the end differences is 0 within the jitter of gloo's worker threads on
    # shared cores (milliseconds for a single collective; the median of 24 is tighter: 2.5 ms on two cores loaded by
    # other work); a misaligned pair would be off by a collective's spacing or a step
    assert abs(float(offset)) < 5000.0, line
