"""Ring attention in one process: C threads run the engine's own ring_forward / ring_backward, exchanging through
in-process mailboxes in the order the ring would. It exercises the real message protocol (which block a rank holds
at each step, the dK/dV partial sums travelling with the K/V blocks) without a process group, so the tests can
count the messages against the ledger's formula and a device script can run the CUDA block kernels through it."""
from __future__ import annotations

import math
import queue
import threading
from typing import Callable

import torch

from engine.context_parallel import get_batch_on_this_cp_rank
from engine.transformer.ring_attention import (
    CPGroup,
    math_block_backward,
    math_block_forward,
    ring_backward,
    ring_forward,
)


class Mailboxes:
    """The ring's sends and receives between threads: a message to `dst` waits in dst's box for its receive."""

    def __init__(self, size: int):
        self.boxes = [queue.Queue() for _ in range(size)]
        self.sent: list[list[tuple[str, int]]] = [[] for _ in range(size)]

    def exchange(self, rank: int, dst: int, kind: str):
        def post(message: torch.Tensor, step: int):
            self.sent[rank].append((kind, message.shape[0]))
            self.boxes[dst].put(message.clone())
            box = self.boxes[rank]
            return type("Flight", (), {"wait": lambda _self: box.get(timeout=30)})()
        return post


def simulate_ring(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, cp: int,
                  attend: Callable = math_block_forward, attend_backward: Callable = math_block_backward):
    """Every CP rank's (out, dq, dk, dv) from the ring, each rank a thread, plus the messages each rank sent
    (forward, backward). q, k, v, dout are the whole sequence's [b, heads, s, d]; each rank takes its chunks."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    split = lambda t: [get_batch_on_this_cp_rank(t, cp, r, dim=2) for r in range(cp)]  # noqa: E731
    qs, ks, vs, douts = split(q), split(k), split(v), split(dout)
    forward_boxes, backward_boxes = Mailboxes(cp), Mailboxes(cp)
    results: dict[int, tuple] = {}
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            if q.is_cuda:
                torch.cuda.set_device(q.device)
            group = CPGroup(group=None, size=cp, rank=r, next_rank=(r + 1) % cp, prev_rank=(r - 1) % cp)
            out, lse, last = ring_forward(qs[r], torch.stack((ks[r], vs[r])), group, scale, attend,
                                          forward_boxes.exchange(r, (r + 1) % cp, "kv"))
            dq, dkv = ring_backward(douts[r], qs[r], last, out.to(q.dtype), lse, group, scale, attend_backward,
                                    backward_boxes.exchange(r, (r - 1) % cp, "kv_dkv"))
            results[r] = (out, dq, dkv[0], dkv[1])
        except BaseException as exc:  # reported by the caller, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(cp)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results, forward_boxes.sent, backward_boxes.sent
