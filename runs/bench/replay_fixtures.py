"""Replay every committed trace's execution graph and print, per profiled step: the measured step, the replayed one
and the error, the critical path's split, and the step decomposition's terms (docs/formulas.md, "Step
decomposition"; for a run directory, as its reconciliation's rows give them); and, per run, how much its first
profiled step grows when its GPU work (or its gloo workers' time) is doubled. Torch-free; runs anywhere from the
repository root:

    python3 runs/bench/replay_fixtures.py
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from common.intervals import length, union  # noqa: E402
from ledger.evidence.critical_path import critical_path  # noqa: E402
from ledger.evidence.exec_graph import ExecGraph, GpuOp, HostOp, read_graph  # noqa: E402
from ledger.evidence.replay import HOST, RUN, Replay, replay  # noqa: E402
from ledger.evidence.step_partition import nccl_spans, partition_step, with_arrivals  # noqa: E402
from ledger.reconcile.run import reconcile  # noqa: E402
from ledger.reconcile.step_decomposition import TERM_METRIC, term_of  # noqa: E402

FIXTURES = ROOT / "tests/fixtures"
# (run directory or None, its traces): a run directory's terms come from its reconciliation (collectives named by
# group); the PP2 slice is no run directory: its SendRecv pairs are matched here and are the pipeline's.
TRACES = [("h200_2layer_profiled", ["traces/rank0.step4-5.json.gz"]),
          ("gpu_h200_llama1b_l2", ["traces/rank0.step3-4.json.gz"]),
          ("megatron_lm_1gpu", ["torch_profile/rank-0.json.gz"]),
          ("gloo_dp2_overlap", ["traces/rank0.step3-4.json.gz"]), ("gloo_dp2_sweeps", ["traces/rank0.step4-5.json.gz"]),
          ("gloo_pp2", ["traces/rank0.step3-4.json.gz"]), (None, ["h200_pp2_p2p_slice/rank0.json.gz",
                                                                 "h200_pp2_p2p_slice/rank1.json.gz"])]


def main() -> None:
    for run, traces in TRACES:
        paths = [FIXTURES / (run or "") / t for t in traces]
        t0 = time.perf_counter()
        graphs = [read_graph(p) for p in paths]
        t1 = time.perf_counter()
        rp = replay(graphs)
        t2 = time.perf_counter()
        starts = sorted(abs(rp.times[v] - rp.measured[v]) for v, p in enumerate(rp.points)
                        if isinstance(p.item, GpuOp) and not p.end)
        print(f"== {run or ' + '.join(traces)}: read {t1 - t0:.2f} s, replay {t2 - t1:.2f} s; latencies "
              + "; ".join(f"rank {r}: launch {lat.launch:.1f} queue {lat.queue:.1f} wake {lat.wake:.1f} us"
                          for r, lat in rp.latencies.items())
              + (f"; GPU op starts replayed within median {statistics.median(starts):.0f} us, max "
                 f"{starts[-1]:.0f} us" if starts else ""))
        if run:
            print("  " + sensitivity(graphs[0], rp))
        terms = reconciled_terms(FIXTURES / run) if run else sliced_terms(graphs)
        for s in rp.steps:
            path = critical_path(rp, s.rank, s.step)
            split = ", ".join(f"{k} {v / 1e3:.2f}" for k, v in sorted(path.by_kind().items(), key=lambda kv: -kv[1])
                              if v >= 0.01 * path.length)
            found = terms[(s.rank, s.step)]
            print(f"  rank {s.rank} step {s.step}: measured {s.measured / 1e3:.3f} ms, replayed "
                  f"{s.replayed / 1e3:.3f} ms, error {s.error:+.3%}\n    critical path (ms): {split}\n"
                  f"    terms (ms, sum {sum(found.values()):.3f}): "
                  + ", ".join(f"{k} {v:.2f}" for k, v in found.items() if v > 0))


def sensitivity(g: ExecGraph, rp: Replay) -> str:
    """The first profiled step again with its own GPU work doubled (a GPU trace) or its gloo workers' time doubled
    (a CPU trace): how much it grows, against that work's share of its critical path and all of it in the step."""
    s = rp.steps[0]
    window = g.steps[s.step]
    segments = critical_path(rp, s.rank, s.step).segments
    if g.on_gpu:
        changed = {id(op) for op in g.gpu_ops() if op.start >= window.start}
        again = replay([g], gpu_duration=lambda op: (2 if id(op) in changed else 1) * (op.end - op.start))
        critical = sum(seg.duration for seg in segments if seg.kind == RUN and id(seg.op) in changed)
        total = sum(op.end - op.start for op in g.gpu_ops() if window.start <= op.start <= window.end)
        what = "its GPU work"
    else:
        workers = {t.thread for t in g.threads if t.comm_worker}

        def mine(op: HostOp | None) -> bool:
            return op is not None and op.thread in workers and op.start >= window.start

        again = replay([g], host_factor=lambda op: 2.0 if mine(op) else 1.0)
        critical = sum(seg.duration for seg in segments if seg.kind == HOST and mine(seg.op))
        total = sum(length(union((max(op.start, window.start), min(op.end, window.end)) for op in t.ops if mine(op)))
                    for t in g.threads if t.thread in workers)
        what = "its gloo workers' time"
    grown = again.steps[0].replayed - s.replayed
    return (f"step {s.step} with {what} doubled: +{grown / 1e3:.3f} ms (that work on the critical path "
            f"{critical / 1e3:.3f} ms, all of it in the step {total / 1e3:.3f} ms)")


def reconciled_terms(run: Path) -> dict[tuple[int, int], dict[str, float]]:
    out: dict[tuple[int, int], dict[str, float]] = {}
    for r in reconcile(run).rows:
        if r.metric.startswith(TERM_METRIC):
            out.setdefault((r.rank, r.step), {})[term_of(r.metric)] = r.measured * 1e3
    return out


def sliced_terms(graphs: list[ExecGraph]) -> dict[tuple[int, int], dict[str, float]]:
    """The slice's terms: its matched SendRecv pairs are the pipeline's (its compute kernels were cut out)."""
    items = [item for g in graphs for item in nccl_spans(g, lambda c: "pp")]
    spans = with_arrivals(items)
    return {(g.rank, n): {k: v / 1e3 for k, v in partition_step(
        g, n, [s for (rank, _, _), s in zip(items, spans) if rank == g.rank]).terms} for g in graphs for n in g.steps}


if __name__ == "__main__":
    main()
