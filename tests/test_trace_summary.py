"""What a trace summary and the step selection keep, on small hand-written inputs with answers worked out here, and
on the recorded gloo runs where the claim is about what torch.profiler writes."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

from common.arguments import parse_args
from common.intervals import length, subtract, union
from ledger.evidence.steps import FROM_CONFIG, FROM_RECORDS, PROFILED_COUNTED, select_steps
from ledger.evidence.traces import summarize
from tests.support.records import typed

FIXTURES = Path(__file__).parent / "fixtures"


def annotation(name: str, ts: float, dur: float, tid: int = 1) -> dict:
    return {"ph": "X", "cat": "user_annotation", "name": name, "pid": 7, "tid": tid, "ts": ts, "dur": dur}


def test_cpu_compute_leaves_out_the_time_a_thread_was_blocked(tmp_path: Path):
    # forward 0-100 on the main thread holds a synchronous TP all-reduce (20-30) and the DDP pre-hook's wait
    # (50-70); gloo's worker thread runs an async all-gather (40-90) beside it: that is communication, not a hole.
    events = [annotation("ProfilerStep#2", 0, 200), annotation("forward stage0 mb0", 0, 100),
              annotation("tp all-reduce", 20, 10), annotation("wait all-gather bucket1", 50, 20),
              annotation("gloo:all_gather", 40, 50, tid=2), annotation("backward stage0 mb0", 120, 60)]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = summarize(path)
    assert s.compute == [(0, 20), (30, 50), (70, 100), (120, 180)]
    assert length(s.compute) == 100 + 60 - 10 - 20


def test_p2p_sizes_come_from_the_dispatcher_ops_not_the_kernels(tmp_path: Path):
    dims = [[[4096, 1, 2048]], [], [], []]
    events = [annotation("ProfilerStep#9", 0, 1000),
              {"ph": "X", "cat": "cpu_op", "name": "c10d::send", "pid": 7, "tid": 1, "ts": 10, "dur": 1,
               "args": {"Input Dims": dims, "Input type": ["TensorList", "", "Scalar", "Scalar"]}},
              {"ph": "X", "cat": "cpu_op", "name": "c10d::recv_", "pid": 7, "tid": 1, "ts": 12, "dur": 1,
               "args": {"Input Dims": dims, "Input type": ["TensorList", "", "Scalar", "Scalar"]}},
              {"ph": "X", "cat": "kernel", "name": "ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)",
               "pid": 0, "tid": 5, "ts": 20, "dur": 30, "args": {"In msg nelems": 5, "dtype": "Float"}}]
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    s = summarize(path)
    assert [(p.op, p.elements) for p in s.p2p] == [("send", 4096 * 2048), ("recv", 4096 * 2048)]
    (kernel,) = s.collectives
    assert kernel.op == "send_recv" and kernel.bytes is None  # counted once, from the ops


def test_subtract_cuts_holes_out_of_disjoint_intervals():
    assert subtract(union([(0, 10), (20, 30)]), union([(2, 3), (5, 25), (29, 40)])) == [(0, 2), (3, 5), (25, 29)]
    assert subtract([(0, 10)], []) == [(0, 10)] and subtract([], [(1, 2)]) == []


def test_a_step_one_rank_profiled_is_disturbed_on_every_rank():
    records = [{"step": s, "profiled": s in (3, 4, 5) and rank == 0, "after_trace_export": s == 6}
               for rank in (0, 1) for s in range(1, 9)]
    sel = select_steps(None, 2, typed("step", records))
    assert sel.source == FROM_RECORDS and sel.first == 1
    assert sel.steady(range(1, 9)) == [2, 7, 8]
    kept, note = sel.timed([3, 4])  # nothing steady among them: kept, and the figure says what is in it
    assert kept == [3, 4] and note == PROFILED_COUNTED


def test_runs_without_flags_take_the_profiler_window_from_their_config():
    cfg = parse_args(["--model", "tiny", "--use-pytorch-profiler", "--profile-step-start", "3", "--profile-step-end",
                      "4", "--profile-ranks", "0", "--train-iters", "8", "--global-batch-size", "2",
                      "--tensor-model-parallel-size", "2"], world_size=4)
    records = typed("step", [{"step": s} for s in range(1, 9)])
    sel = select_steps(cfg, 4, records)
    # torch.profiler: steps 3-4 plus the one HTA drops (5), then the export every rank waits for in step 6
    assert sel.source == FROM_CONFIG and sel.profiled == {3, 4, 5} and sel.after_export == {6}
    assert not select_steps(cfg, 1, records).after_export  # a world of one waits for nobody


def test_gloo_collectives_are_read_through_the_c10d_op_that_issued_them():
    """gloo's own annotation calls a reduce-scatter "gloo:all_reduce" and shows an all-gather's input only; the
    dispatcher's c10d op that issued it names the collective and holds every tensor. The recorded DP2 run (distributed
    optimizer, --overlap-param-gather) has three buckets of 46208, 46208 and 64128 elements (its inventory): every
    traced step reduce-scatters each fp32 grad bucket and all-gathers each bf16 param bucket, nccl-tests' size being
    the whole bucket for both."""
    s = summarize(next((FIXTURES / "gloo_dp2_overlap" / "traces").glob("rank0.*")))
    buckets = [46208, 46208, 64128]
    per_step: dict[tuple[int, str], list[int]] = defaultdict(list)
    for c in s.collectives:
        step = next(n for n, (lo, hi) in s.windows().items() if lo <= c.start <= hi)
        per_step[(step, c.op)].append(c.bytes)
    assert sorted(s.windows()) == [3, 4, 5]
    for step in (3, 4, 5):
        assert sorted(per_step[(step, "reduce_scatter")]) == [4 * n for n in buckets]
        assert sorted(per_step[(step, "all_gather")]) == [2 * n for n in buckets]
        # what is left: fp32 scalars (the loss, and the grad norm over each of its two groups)
        assert per_step[(step, "all_reduce")] == [4, 4, 4]


def test_a_gloo_collective_knows_the_engine_range_it_was_issued_in():
    """The tied embedding's grad all-reduce is issued inside the engine's "all-reduce word embedding grads" range on
    the main thread, while gloo runs it on a worker thread of its process group; the loss broadcast and the grad-norm
    all-reduce are issued outside any communication range (in the optimizer's and the iteration's tail)."""
    s = summarize(next((FIXTURES / "gloo_pp2" / "traces").glob("rank0.*")))
    collectives = [c for c in s.collectives if c.op not in ("send", "recv")]
    embedding = [c for c in collectives if c.issued_in == "all-reduce word embedding grads"]
    assert [(c.op, c.bytes) for c in embedding] == [("all_reduce", 1000 * 64 * 4)] * 3
    others = sorted((c.op, c.bytes, c.issued_in) for c in collectives if c not in embedding)
    assert others == [("all_reduce", 4, "optimizer")] * 3 + [("broadcast", 4, "iteration")] * 3
    # a process group's work runs on its own worker threads: no thread carries two of these three kinds of work
    kinds = defaultdict(set)
    for c in collectives:
        kinds[c.thread].add((c.op, c.bytes))
    assert all(len(k) == 1 for k in kinds.values()) and len(kinds) >= 3
