"""Mixture of experts: how many token assignments a rank routes and its experts process, and the all-to-all volume
that moves them, from the config (uniform routing) or from the routing a run observed. Pure arithmetic on counts;
docs/formulas.md, "Mixture of experts", derives each.

Routing (Megatron's TopKRouter and MoEAlltoAllTokenDispatcher): each of a rank's T tokens of a micro-batch picks k of
the E experts (T k assignments). With a capacity factor c each expert keeps at most ceil(T k / E x c) of one rank's
assignments of the micro-batch (Megatron's get_capacity over the T k assignments); the rest are dropped on the
sending rank and never sent. EP rank j holds experts j E/EP ... (j + 1) E/EP - 1.

All-to-all, per MoE layer per micro-batch, one row of h values (activation dtype) per kept assignment:
- dispatch forward: every kept assignment of this rank's tokens goes to the rank holding its expert (its own share
  included in the buffer: nccl-tests' size; the rest leaves the rank);
- combine forward: the expert outputs go back, so a rank's input is what its experts received;
- their backwards are all-to-alls of the gradients the other way: dispatch's takes the received rows, combine's the
  sent ones.
So a layer moves 2 (sent + received) rows of size, 2 (sent_remote + received_remote) of them between ranks; a full
recompute re-runs the two forward all-to-alls of each checkpointed layer. Under uniform routing sent = received =
kept and the remote share is (EP - 1)/EP. Before the rows, each rank exchanges its per-expert counts (E int64 a layer
per forward: the split sizes), counted apart.
"""
from __future__ import annotations

from dataclasses import dataclass

from common.config import ModelConfig
from common.ops.sizes import uniform_kept_assignments

COUNT_BYTES = 8  # the per-expert counts exchanged before the rows: int64




@dataclass(frozen=True)
class RankExchange:
    """One rank's rows in one layer's dispatch (summed over whatever the counts were summed over: micro-batches)."""
    sent: int  # kept assignments of this rank's tokens, its own experts' included
    sent_remote: int  # of those, bound for other EP ranks
    received: int  # rows this rank's experts process, from every EP rank, its own included
    received_remote: int  # of those, from other EP ranks

    @property
    def link_rows(self) -> int:
        """What one all-to-all of the layer puts through this rank's link in its busier direction."""
        return max(self.sent_remote, self.received_remote)


def exchanges(kept: list[list[int]], ep: int) -> list[RankExchange]:
    """Each EP rank's exchange of one layer, from `kept[r][e]`: the assignments EP rank r's router kept for global
    expert e (tokens per expert minus dropped). Rows of one EP group, indexed by EP rank."""
    if len(kept) != ep:
        raise ValueError(f"routing of {len(kept)} EP rank(s) for an EP group of {ep}")
    num_experts = len(kept[0])
    per = num_experts // ep
    out = []
    for r in range(ep):
        local = range(r * per, (r + 1) * per)
        own = sum(kept[r][e] for e in local)
        received = sum(kept[s][e] for s in range(ep) for e in local)
        sent = sum(kept[r])
        out.append(RankExchange(sent=sent, sent_remote=sent - own, received=received, received_remote=received - own))
    return out


@dataclass(frozen=True)
class AllToAllVolume:
    """A rank's dispatch and combine all-to-alls in one step (forward, backward and recompute): buffer bytes
    (nccl-tests' size, own share included), the part that leaves the rank, and the number of all-to-alls."""
    size_bytes: int
    remote_bytes: int
    calls: int

    def __add__(self, other: "AllToAllVolume") -> "AllToAllVolume":
        return AllToAllVolume(self.size_bytes + other.size_bytes, self.remote_bytes + other.remote_bytes,
                              self.calls + other.calls)


NO_VOLUME = AllToAllVolume(0, 0, 0)


def passes(recomputed: bool) -> int:
    """A layer's passes per micro-batch that run a dispatch and a combine: forward, backward, and a full recompute's
    re-run of the forward."""
    return 3 if recomputed else 2


def layer_volume(x: RankExchange, row_bytes: int, microbatches: int, recomputed: bool) -> AllToAllVolume:
    """One layer's four all-to-alls per micro-batch (two more when a full recompute re-runs its forward), for an
    exchange summed over the step's `microbatches` micro-batches."""
    n = passes(recomputed)
    return AllToAllVolume(size_bytes=n * (x.sent + x.received) * row_bytes,
                          remote_bytes=n * (x.sent_remote + x.received_remote) * row_bytes,
                          calls=2 * n * microbatches)


def uniform_exchange(tokens: int, model: ModelConfig, ep: int) -> RankExchange:
    """A rank's exchange in one layer for one micro-batch under uniform routing."""
    kept = uniform_kept_assignments(tokens, model)
    remote = kept * (ep - 1) // ep
    return RankExchange(sent=kept, sent_remote=remote, received=kept, received_remote=remote)
