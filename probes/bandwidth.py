"""Start-up collective sweep on the run's own groups, at the run's own sizes, so the ledger can predict comm time.

What is swept (groups of one rank are skipped: nothing moves):
  dp  reduce_scatter (grad dtype), all_gather (param dtype), all_reduce (grad dtype) at each distinct DDP bucket
      size, padded up to a multiple of the group size as Megatron pads its buckets;
  tp  all_reduce, all_gather, reduce_scatter at the activation size (the full, unsharded tensor);
  pp  send/recv of one activation to the next stage while receiving from the previous one (a ring: every link busy
      at once, as in steady 1F1B).
Figures follow nccl-tests: `size_bytes` S is the all_reduce buffer, the all_gather output, the reduce_scatter input,
the bytes one rank sends; algbw = S / time; busbw = algbw x 2(n-1)/n for all_reduce, x (n-1)/n for all_gather and
reduce_scatter, x 1 for send/recv. `time_s` is this rank's mean over the timed iterations, after warm-up; the ledger
takes the slowest rank of a group as the group's time, as nccl-tests does.
"""
from __future__ import annotations

import time
from typing import Any, Callable

import torch
import torch.distributed as dist

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
}


def to_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def bandwidth_figures(collective: str, size_bytes: int, time_s: float, group_size: int) -> dict[str, float]:
    algbw = size_bytes / time_s / 1e9
    return {"algbw_GBps": algbw, "busbw_GBps": algbw * BUS_FACTOR[collective](group_size)}


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


class Sweep:
    """One rank's part of the sweep; every rank of the world must run `run` with the same sizes (collective)."""

    def __init__(self, parallel_state: Any, device: torch.device, warmup: int, iters: int):
        self.ps, self.device, self.warmup, self.iters = parallel_state, device, warmup, iters
        self.backend = dist.get_backend()

    def run(self, dp_bucket_numels: list[int], dp_grad_dtype: Any, dp_param_dtype: Any, activation_numel: int,
            activation_dtype: Any) -> list[dict[str, Any]]:
        records = []
        dp_n = self.ps.dp_size * self.ps.cp_size
        if dp_n > 1:
            for numel in sorted(set(dp_bucket_numels)):
                padded = -(-numel // dp_n) * dp_n
                for collective, dtype in (("reduce_scatter", dp_grad_dtype), ("all_gather", dp_param_dtype),
                                          ("all_reduce", dp_grad_dtype)):
                    records.append(self._collective("dp", "dp_cp", collective, padded, to_dtype(dtype)))
        if self.ps.tp_size > 1 and activation_numel:
            padded = -(-activation_numel // self.ps.tp_size) * self.ps.tp_size
            for collective in ("all_reduce", "all_gather", "reduce_scatter"):
                records.append(self._collective("tp", "tp", collective, padded, to_dtype(activation_dtype)))
        if self.ps.pp_size > 1 and activation_numel:
            records.append(self._send_recv(activation_numel, to_dtype(activation_dtype)))
        return records

    def _collective(self, label: str, kind: str, collective: str, numel: int, dtype: torch.dtype) -> dict[str, Any]:
        group, n = self.ps.groups[kind], len(self.ps.ranks[kind])
        full = torch.zeros(numel, dtype=dtype, device=self.device)
        shard = torch.zeros(numel // n, dtype=dtype, device=self.device)
        op = {"all_reduce": lambda: dist.all_reduce(full, group=group),
              "all_gather": lambda: _all_gather(full, shard, group),
              "reduce_scatter": lambda: _reduce_scatter(shard, full, group)}[collective]
        time_s = self._time(op, group)
        size = numel * full.element_size()
        return self._record(label, collective, n, self.ps.ranks[kind], dtype, numel, size, time_s)

    def _send_recv(self, numel: int, dtype: torch.dtype) -> dict[str, Any]:
        group = self.ps.groups["pp"]
        send = torch.zeros(numel, dtype=dtype, device=self.device)
        recv = torch.empty_like(send)

        def op() -> None:
            ops = [dist.P2POp(dist.isend, send, self.ps.pipeline_next_rank, group),
                   dist.P2POp(dist.irecv, recv, self.ps.pipeline_prev_rank, group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        time_s = self._time(op, group)
        size = numel * send.element_size()
        return self._record("pp", "send_recv", self.ps.pp_size, self.ps.ranks["pp"], dtype, numel, size, time_s)

    def _time(self, op: Callable[[], None], group: Any) -> float:
        for _ in range(self.warmup):
            op()
        self._sync(group)
        t0 = time.perf_counter()
        for _ in range(self.iters):
            op()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t0) / self.iters

    def _sync(self, group: Any) -> None:
        """Line the group up so that no rank's timing starts while a peer is still warming up."""
        flag = torch.zeros(1, device=self.device)
        dist.all_reduce(flag, group=group)
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def _record(self, label: str, collective: str, n: int, ranks: list[int], dtype: torch.dtype, numel: int,
                size: int, time_s: float) -> dict[str, Any]:
        return {"group": label, "collective": collective, "group_size": n, "ranks": list(ranks),
                "dtype": str(dtype).removeprefix("torch."), "numel": numel, "size_bytes": size, "time_s": time_s,
                **bandwidth_figures(collective, size, time_s, n), "iters": self.iters, "backend": self.backend}
