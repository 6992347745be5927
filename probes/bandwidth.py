"""Start-up collective sweep on the run's own groups, at the run's own sizes, so the ledger can predict comm time.

What is swept (groups of one rank are skipped: nothing moves):
  dp       reduce_scatter (grad dtype), all_gather (param dtype), all_reduce (grad dtype) at each distinct dense DDP
           bucket size, padded up to a multiple of the group size as Megatron pads its buckets, on dp x cp;
  expt_dp  the same at each distinct expert bucket size, on the expert-data-parallel group (an MoE model's expert
           buffers are reduced there, not over dp x cp);
  tp       all_reduce, all_gather, reduce_scatter at the activation size (the full, unsharded tensor);
  pp       send/recv of one activation to the next stage while receiving from the previous one (a ring: every link
           busy at once, as in steady 1F1B);
  ep       all_to_all of one micro-batch's dispatch: tokens x top-k rows of h, split evenly over the group (uniform
           routing; the combine, and each backward, moves the same buffer);
  cp       send/recv on the context-parallel ring (to the next CP rank, from the previous one) of each message the
           ring attention sends: the K/V block, and in backward the K/V block with the previous block's dK/dV.
Figures follow nccl-tests: `size_bytes` S is the all_reduce buffer, the all_gather output, the reduce_scatter input,
the all_to_all input (the rank's own share included), the bytes one rank sends; algbw = S / time; busbw = algbw x
2(n-1)/n for all_reduce, x (n-1)/n for all_gather, reduce_scatter and all_to_all, x 1 for send/recv. `time_s` is this
rank's mean over the timed iterations, after warm-up; the ledger takes the slowest rank of a group as the group's
time, as nccl-tests does.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BUS_FACTOR: dict[str, Callable[[int], float]] = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_to_all": lambda n: (n - 1) / n,
    "send_recv": lambda n: 1.0,
}
DP_COLLECTIVES = ("reduce_scatter", "all_gather", "all_reduce")


@dataclass(frozen=True)
class SweepSizes:
    """What a run communicates, in elements (dtypes as names of DTYPES or torch dtypes); empty or 0: not swept.
    Every rank of a group passes the same sizes for that group (the engine derives them from the run's config and
    the rank's buffers, which a group's members share)."""
    dp_bucket_numels: Sequence[int] = ()
    dp_grad_dtype: Any = "fp32"
    dp_param_dtype: Any = "fp32"
    expert_bucket_numels: Sequence[int] = ()
    activation_numel: int = 0
    activation_dtype: Any = "fp32"
    ep_dispatch_numel: int = 0  # one micro-batch's dispatch buffer, in activation_dtype
    cp_message_numels: Sequence[int] = ()  # the ring's messages, in activation_dtype

    def latency(self) -> "SweepSizes":
        """One element per rank of everything swept: the time model fits latency + size / bandwidth and needs a
        size where the latency dominates (a 4-byte all-reduce is priced at it)."""
        def one(numels: Sequence[int]) -> list[int]:
            return [1] if numels else []

        return replace(self, dp_bucket_numels=one(self.dp_bucket_numels),
                       expert_bucket_numels=one(self.expert_bucket_numels),
                       activation_numel=min(1, self.activation_numel),
                       ep_dispatch_numel=min(1, self.ep_dispatch_numel), cp_message_numels=one(self.cp_message_numels))


def to_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def bandwidth_figures(collective: str, size_bytes: int, time_s: float, group_size: int) -> dict[str, float]:
    algbw = size_bytes / time_s / 1e9
    return {"algbw_GBps": algbw, "busbw_GBps": algbw * BUS_FACTOR[collective](group_size)}


def _pad(numel: int, n: int) -> int:
    """Up to a multiple of the group size, so that every rank's share is whole."""
    return -(-numel // n) * n


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, group=group)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    fn(out, inp, group=group)


class Sweep:
    """One rank's part of the sweep; every rank of the world must run `run` (collective), the members of each group
    with the same sizes for it."""

    def __init__(self, parallel_state: Any, device: torch.device, warmup: int, iters: int):
        self.ps, self.device, self.warmup, self.iters = parallel_state, device, warmup, iters
        self.backend = dist.get_backend()

    def run(self, sizes: SweepSizes) -> list[dict[str, Any]]:
        ps, dtype = self.ps, to_dtype(sizes.activation_dtype)
        records = self._buckets("dp", "dp_cp", ps.dp_size * ps.cp_size, sizes.dp_bucket_numels, sizes)
        records += self._buckets("expt_dp", "expt_dp", ps.expert_dp_size, sizes.expert_bucket_numels, sizes)
        if ps.tp_size > 1 and sizes.activation_numel:
            padded = _pad(sizes.activation_numel, ps.tp_size)
            for collective in ("all_reduce", "all_gather", "reduce_scatter"):
                records.append(self._collective("tp", "tp", collective, padded, dtype))
        if ps.pp_size > 1 and sizes.activation_numel:
            records.append(self._send_recv("pp", sizes.activation_numel, dtype))
        if ps.ep_size > 1 and sizes.ep_dispatch_numel:
            records.append(self._collective("ep", "ep", "all_to_all", _pad(sizes.ep_dispatch_numel, ps.ep_size),
                                            dtype))
        if ps.cp_size > 1:
            records += [self._send_recv("cp", numel, dtype) for numel in sorted(set(sizes.cp_message_numels))]
        return records

    def _buckets(self, label: str, kind: str, n: int, numels: Sequence[int],
                 sizes: SweepSizes) -> list[dict[str, Any]]:
        """The DP collectives of each distinct bucket size on one data-parallel group of n ranks."""
        if n <= 1:
            return []
        dtypes = {"reduce_scatter": sizes.dp_grad_dtype, "all_gather": sizes.dp_param_dtype,
                  "all_reduce": sizes.dp_grad_dtype}
        return [self._collective(label, kind, collective, _pad(numel, n), to_dtype(dtypes[collective]))
                for numel in sorted(set(numels)) for collective in DP_COLLECTIVES]

    def _collective(self, label: str, kind: str, collective: str, numel: int, dtype: torch.dtype) -> dict[str, Any]:
        group, n = self.ps.groups[kind], len(self.ps.ranks[kind])
        full = torch.zeros(numel, dtype=dtype, device=self.device)
        shard = torch.zeros(numel // n, dtype=dtype, device=self.device)
        received = torch.empty_like(full) if collective == "all_to_all" else None
        op = {"all_reduce": lambda: dist.all_reduce(full, group=group),
              "all_gather": lambda: _all_gather(full, shard, group),
              "reduce_scatter": lambda: _reduce_scatter(shard, full, group),
              "all_to_all": lambda: dist.all_to_all_single(received, full, group=group)}[collective]
        time_s = self._time(op, group)
        size = numel * full.element_size()
        return self._record(label, collective, n, self.ps.ranks[kind], dtype, numel, size, time_s)

    def _send_recv(self, kind: str, numel: int, dtype: torch.dtype) -> dict[str, Any]:
        """Each rank of a ring group ("pp", "cp") sends to the next member while receiving from the previous one."""
        group, ranks = self.ps.groups[kind], self.ps.ranks[kind]
        position = ranks.index(self.ps.rank)
        following, preceding = ranks[(position + 1) % len(ranks)], ranks[(position - 1) % len(ranks)]
        send = torch.zeros(numel, dtype=dtype, device=self.device)
        recv = torch.empty_like(send)

        def op() -> None:
            ops = [dist.P2POp(dist.isend, send, following, group), dist.P2POp(dist.irecv, recv, preceding, group)]
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        time_s = self._time(op, group)
        size = numel * send.element_size()
        return self._record(kind, "send_recv", len(ranks), ranks, dtype, numel, size, time_s)

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
