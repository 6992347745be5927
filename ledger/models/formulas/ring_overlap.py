"""How much of ring attention's K/V exchange the attention computed beside it hides, predicted from the config and a
calibration (a transfer time per message size, an attention rate in seconds per FLOP).

Why per exchange: ring attention (engine/transformer/ring_attention.py, Transformer Engine's AttnFuncWithCPAndKVP2P)
issues each message before the block it runs beside and waits for it after that block, so a message is hidden
while it is no slower than its block and exposed by the excess when it is. A constant "all hidden" would claim that
for any link and any s/C; this prices both sides instead.

The exchanges of one layer's pass on CP rank i of C (ledger/models/formulas/comm.py derives the messages), with
L = s/C local tokens, b the micro-batch, h = n_q/t the rank's query heads, d the head dim:
  - forward step j < C - 1: sends the K/V block it holds (|KV|) beside the block of rank i - j (step 0: its own);
  - backward step j (every step): message j of ring_messages (|KV|, then 2 |KV| C - 2 times, then |KV|) beside the
    block of rank i + 1 + j (step C - 1: its own);
  - a re-run forward (recompute) repeats the forward's exchanges.
A block's attention FLOPs (QK^T and PV, 2 FLOPs per multiply-add, each 2 d per query-key pair: 4 d per pair):
  - its own block (the diagonal): causal over the local 2 chunks, L x L / 2 pairs: 2 b h L^2 d;
  - another rank's: the local queries against the first half of its keys, or the second half of the queries
    against all its keys (the causal load balancing makes every such step one of the two), unmasked, L x L / 2
    pairs: 2 b h L^2 d as well;
  - backward 2.5x the forward, flash attention's: the catalogue's ring blocks (common/ops/attention.py).
Which block a step computes (`ring_blocks`): the rank's own, causal over its s/C x s/C, at forward step 0 and at
backward step C - 1; at every other step another rank's, an unmasked half block.
Exposed part of one exchange: max(0, transfer seconds - block seconds), what the pass waits for after the block
(`exchange_exposed`: the time model adds it to the pass); hidden share: 1 - exposed / transfer = min(1, block /
transfer) (`exchange_hidden`: the overlap row). The step's figure is the mean over its exchanges weighted by their
bytes (each layer and micro-batch runs the same exchanges: `count` of each), which is the share of the ring's transfer
time that is hidden when a message's time is its bytes over one bandwidth.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from common.config import RunConfig
from common.ops import Shapes
from common.ops.attention import ring_block
from ledger.models.formulas.comm import kv_block_bytes, ring_messages, ring_passes

FORWARD, BACKWARD = "forward", "backward"


@dataclass(frozen=True)
class RingExchange:
    """One exchange of one layer's ring pass and how often a step runs it on this rank."""
    phase: str  # FORWARD (also a recompute's re-run) | BACKWARD
    step: int  # the ring step it runs beside
    message_bytes: int  # what the rank sends (it receives as much): the sweep's send_recv size
    block_flops: float  # the attention computed beside it
    count: int  # per training step on this rank: layers (or re-run layers) x micro-batches
    causal: bool = False  # that block is the rank's own causal diagonal, not an unmasked half block (ring_blocks)


def block_flops(cfg: RunConfig, backward: bool) -> float:
    """Attention FLOPs of one ring step on one rank (module docstring): L x L / 2 query-key pairs on the diagonal
    (causal) and off it (half a block, unmasked) alike, 4 d FLOPs each: 2 b h L^2 d, x 2.5 backward."""
    return ring_block(Shapes.of(cfg), causal=True).of("bwd" if backward else "fwd").flops


def ring_exchanges(cfg: RunConfig, pp_rank: int) -> list[RingExchange]:
    """Every distinct exchange of a training step on a rank of this pipeline stage, with its count; none at C = 1."""
    cp, mb, kv = cfg.parallel.context_parallel_size, cfg.num_microbatches, kv_block_bytes(cfg)
    layers, rerun = ring_passes(cfg, pp_rank)
    forward, backward = ring_blocks(cp, True), ring_blocks(cp, False)
    out = [RingExchange(FORWARD, j, units * kv, block_flops(cfg, False), (layers + rerun) * mb, forward[j])
           for j, units in enumerate(ring_messages(cp, True))]
    out += [RingExchange(BACKWARD, j, units * kv, block_flops(cfg, True), layers * mb, backward[j])
            for j, units in enumerate(ring_messages(cp, False))]
    return out


def ring_blocks(cp: int, forward: bool) -> list[bool]:
    """Per ring step of one layer's pass, whether its block is the causal diagonal (the rank's own K/V: forward step
    0, backward step C - 1, where the backward's ring returns to it) rather than an unmasked half block."""
    own = 0 if forward else cp - 1
    return [step == own for step in range(cp)]


def exchange_exposed(transfer_s: float, block_s: float) -> float:
    """Seconds of one transfer its block does not hide: the wait after the block when the transfer is longer."""
    return max(0.0, transfer_s - block_s)


def exchange_hidden(transfer_s: float, block_s: float) -> float:
    """Share of one transfer that its block hides: all of it when the block lasts at least as long."""
    return 1.0 - exchange_exposed(transfer_s, block_s) / transfer_s if transfer_s > 0 else 1.0


def hidden_fraction(exchanges: list[RingExchange], transfer_s: Callable[[int], float],
                    seconds_per_flop: Mapping[tuple[str, bool], float]) -> float | None:
    """Byte-weighted mean of exchange_hidden over a step's exchanges: `transfer_s(message_bytes)` prices a message,
    `seconds_per_flop[(phase, causal)]` a block of that kind. None without exchanges."""
    weight = sum(e.message_bytes * e.count for e in exchanges)
    if not weight:
        return None
    hidden = sum(e.message_bytes * e.count * exchange_hidden(transfer_s(e.message_bytes),
                                                             e.block_flops * seconds_per_flop[e.phase, e.causal])
                 for e in exchanges)
    return hidden / weight
