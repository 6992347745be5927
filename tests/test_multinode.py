"""The multi-node launcher path (runs/slurm/train.sbatch) on one host: two "nodes", each its own
`train-ledger train --nnodes 2 --nproc-per-node 2 --rdzv-endpoint localhost:PORT` (one torchrun per node, c10d
rendezvous on the first), form one world of 4 ranks that trains exactly as a single process does.
"""
import os
import re
import socket
import subprocess
import sys
import time

import pytest

from common.arguments import parse_args
from tests.support.parity import reference_run

FLAGS = ["--model", "tiny", "--num-layers", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel",
         "--micro-batch-size", "1", "--global-batch-size", "4", "--train-iters", "4", "--lr", "3e-3"]
TIMEOUT = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_two_nodes_on_one_host_train_as_one_world(tmp_path):
    endpoint = f"127.0.0.1:{_free_port()}"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # Files, not pipes: a node whose pipe filled while the test read the other's would block its ranks, and the
    # other node's with them (each waits in a collective).
    logs = [(tmp_path / f"node{n}.out", tmp_path / f"node{n}.err") for n in range(2)]
    nodes = []
    for node, (out, err) in enumerate(logs):
        with out.open("w") as stdout, err.open("w") as stderr:
            nodes.append(subprocess.Popen(
                [sys.executable, "-m", "cli.main", "train", "--nnodes", "2", "--nproc-per-node", "2",
                 "--node-rank", str(node), "--rdzv-endpoint", endpoint, "--rdzv-id", "multinode-test", *FLAGS,
                 "--run-dir", str(tmp_path / "run")], stdout=stdout, stderr=stderr, text=True, env=env))
    deadline = time.monotonic() + TIMEOUT
    try:
        for node in nodes:
            node.wait(timeout=max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        for node in nodes:
            node.kill()
            node.wait()
        pytest.fail(f"a node did not finish within {TIMEOUT} s; what each printed:\n" + "\n".join(
            f"node {n} (exit {node.returncode}): stdout {out.read_text()[-1500:]!r} stderr {err.read_text()[-1500:]!r}"
            for n, (node, (out, err)) in enumerate(zip(nodes, logs))))
    finally:
        for node in nodes:
            node.kill()
    outputs = [(out.read_text(), err.read_text()) for out, err in logs]
    for node, (_, stderr) in zip(nodes, outputs):
        assert node.returncode == 0, stderr[-3000:]
    logged = [out for out, _ in outputs if "world 4 = tp 2 x cp 1 x dp 2 x pp 1" in out]
    assert len(logged) == 1, "global rank 0 lives on exactly one node"
    losses = [float(m) for m in re.findall(r"lm loss: (\S+)", logged[0])]
    expected = reference_run(parse_args(FLAGS, world_size=4))["losses"]
    assert losses == pytest.approx(expected, rel=1e-5)
