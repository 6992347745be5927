"""Hand-written Kineto (torch.profiler Chrome trace) events for plumbing tests of the execution graph: each builder
returns the event dicts torch.profiler writes for one thing (a host op, a launch and its kernel, a sync), with the
fields the ledger reads and nothing else. Claims about what real traces hold are tested on the committed fixtures.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

PID, MAIN = 100, 1


def host(name: str, ts: float, dur: float, cat: str = "cpu_op", tid: int = MAIN, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "pid": PID, "tid": tid, "ts": ts, "dur": dur, "args": args}


def step(n: int, ts: float, dur: float, tid: int = MAIN) -> dict[str, Any]:
    return host(f"ProfilerStep#{n}", ts, dur, cat="user_annotation", tid=tid)


def runtime(name: str, ts: float, dur: float, corr: int | None = None, tid: int = MAIN) -> dict[str, Any]:
    return host(name, ts, dur, cat="cuda_runtime", tid=tid, **({"correlation": corr} if corr is not None else {}))


def gpu(name: str, ts: float, dur: float, stream: int, corr: int | None, cat: str = "kernel",
        **args: Any) -> dict[str, Any]:
    fields = {"stream": stream, **({"correlation": corr} if corr is not None else {}), **args}
    return {"ph": "X", "cat": cat, "name": name, "pid": 0, "tid": stream, "ts": ts, "dur": dur, "args": fields}


def launch(corr: int, call_ts: float, kernel_ts: float, kernel_dur: float, stream: int = 7, tid: int = MAIN,
           name: str = "gemm", **kernel_args: Any) -> list[dict[str, Any]]:
    """A cudaLaunchKernel (5 µs) and the kernel it enqueued, sharing a correlation id."""
    return [runtime("cudaLaunchKernel", call_ts, 5, corr, tid), gpu(name, kernel_ts, kernel_dur, stream, corr,
                                                                    **kernel_args)]


def write_trace(path: Path, events: list[dict[str, Any]], rank: int | None = None, world_size: int = 1) -> Path:
    doc: dict[str, Any] = {"traceEvents": events}
    if rank is not None:
        doc["distributedInfo"] = {"rank": rank, "world_size": world_size, "backend": "nccl"}
    path.write_text(json.dumps(doc))
    return path
