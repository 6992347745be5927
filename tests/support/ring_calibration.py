"""Synthetic calibration records for ring attention's overlap prediction (plumbing: the figures are made up).

`attention_records` and `cp_send_recv_record` write the compute sweep's core attention records and the bandwidth
sweep's cp send_recv record in the run-directory formats (probes/compute_sweep/, probes/bandwidth.py), so a test
can set how long a block and a transfer take and derive the prediction by hand.
"""
from __future__ import annotations

from common.config import RunConfig
from common.events import BandwidthRecord, ComputeRecord
from ledger.models.formulas.comm import kv_block_bytes


def attention_records(cfg: RunConfig, seq: int, forward_s: float, backward_s: float) -> list[ComputeRecord]:
    """core_attention.fwd / .bwd swept at `seq` on this config's TP-local heads, with the sweep's FLOP counts
    (2 b h s^2 d forward, 2.5x backward)."""
    m, t, b = cfg.model, cfg.parallel.tensor_model_parallel_size, cfg.train.micro_batch_size
    dims = dict(batch=b, heads=m.num_attention_heads // t, kv_heads=m.num_query_groups // t, seq=seq,
                head_dim=m.head_dim)
    flops = 2.0 * b * dims["heads"] * seq * seq * m.head_dim
    return [ComputeRecord(op="core_attention.fwd", dims=dims, dtype=cfg.train.params_dtype, flops=flops,
                          seconds=forward_s),
            ComputeRecord(op="core_attention.bwd", dims=dims, dtype=cfg.train.params_dtype, flops=2.5 * flops,
                          seconds=backward_s)]


def cp_send_recv_record(cfg: RunConfig, time_s: float, units: int = 1) -> BandwidthRecord:
    """The bandwidth sweep's send_recv on the cp group at `units` K/V blocks (size_bytes: what one rank sends)."""
    cp = cfg.parallel.context_parallel_size
    return BandwidthRecord(group="cp", collective="send_recv", group_size=cp, ranks=list(range(cp)),
                           dtype=cfg.train.params_dtype, size_bytes=units * kv_block_bytes(cfg), time_s=time_s)
