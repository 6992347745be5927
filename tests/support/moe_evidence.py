"""Synthetic evidence of a 2-rank EP2 MoE run, built in memory (plumbing): the tiny shape with 4 experts, top-2, fp32,
one micro-batch; step records carrying a hand-made routing table, and the "ep-comm" ranges the engine writes for that
routing (dispatch and combine, forward and backward: the input buffer's bytes and the bytes leaving the rank); a
hand-set all-to-all link fit. Every figure below is derived by hand in its comment."""
from __future__ import annotations

from pathlib import Path

from common.arguments import parse_args
from ledger.evidence.run import RankEvidence, RunEvidence
from ledger.models.time_model import Calibration, CommModel, LinkFit
from ledger.reconcile.time_rows import TimeModel
from tests.support.records import typed

ROW = 64 * 4  # h values of fp32 per routed token
LAYERS, STEPS = 4, (1, 2, 3)
# tokens per expert a layer (each rank routes 32 tokens x top-2 = 64); rank 0 holds experts 0, 1, rank 1 2, 3
TOKENS = {0: [20, 12, 16, 16], 1: [30, 20, 10, 4]}
# rank 0: sends 64 (32 to itself, 32 away); its experts get 20 + 12 + 30 + 20 = 82 (50 from rank 1)
# rank 1: sends 64 (14 to itself, 50 away); its experts get 16 + 16 + 10 + 4 = 46 (32 from rank 0)
EXCHANGE = {0: (64, 32, 82, 50), 1: (64, 50, 46, 32)}  # sent, sent remote, received, received remote
ALPHA, BETA = 1e-4, 1e-8  # a hand-set link fit: 100 us a call, 100 MB/s
# a step's 16 all-to-alls (4 layers x dispatch, combine x forward, backward) each wait for the group's busiest link:
# max over ranks of max(sent remote, received remote) = 50 rows
PREDICTED_S = 16 * ALPHA + 16 * 50 * ROW * BETA


def config():
    return parse_args(["--model", "tiny", "--num-experts", "4", "--moe-router-topk", "2",
                       "--expert-model-parallel-size", "2", "--world-size", "2"])


def ranges(rank: int, step: int, exchange: tuple[int, int, int, int], seconds: float) -> list[dict]:
    """What the engine records for one step: per layer the counts exchange, dispatch and combine forward, and their
    backwards (dispatch's backward sends the received rows' gradients back, combine's the sent rows')."""
    sent, sent_remote, received, received_remote = exchange
    out, t = [], float(step)
    for layer in range(LAYERS):
        for name, phase, rows, remote in (("counts", "forward", None, None),
                                          ("dispatch", "forward", sent, sent_remote),
                                          ("combine", "forward", received, received_remote),
                                          ("combine", "backward", sent, sent_remote),
                                          ("dispatch", "backward", received, received_remote)):
            counted = rows is None
            record = {"kind": "timing", "step": step, "category": "ep-comm", "layer": layer, "phase": phase,
                      "name": f"ep all-to-all {name} layer{layer}", "start_s": t,
                      "end_s": t + (1e-6 if counted else seconds), "duration_s": 1e-6 if counted else seconds,
                      "bytes": 4 * 8 if counted else rows * ROW, "remote_bytes": 2 * 8 if counted else remote * ROW}
            out.append(record)
            t = record["end_s"]
    return out


def evidence(dropped: dict[int, list[int]] | None = None) -> RunEvidence:
    cfg = config()
    ranks = {}
    for rank in (0, 1):
        drop = (dropped or {}).get(rank, [0] * 4)
        kept = [t - d for t, d in zip(TOKENS[rank], drop)]
        exchange = exchange_of(rank, kept, (dropped or {}))
        steps = [{"kind": "step", "step": s, "step_time_s": 0.1, "tokens": 64,
                  "moe_tokens_per_expert": {str(n): TOKENS[rank] for n in range(LAYERS)},
                  "moe_dropped_tokens": {str(n): drop for n in range(LAYERS)}} for s in STEPS]
        timing = [t for s in STEPS for t in ranges(rank, s, exchange, PREDICTED_S / 16)]
        ranks[rank] = RankEvidence(rank=rank, coords={"tp": 0, "cp": 0, "dp": rank, "pp": 0},
                                   steps=typed("step", steps), timing=typed("timing", timing))
    manifest = {"world_size": 2, "status": "complete", "run_id": "synthetic-moe"}
    return RunEvidence(run_dir=Path("."), manifest=manifest, config=cfg, ranks=ranks, traces=[])


def exchange_of(rank: int, kept: list[int], dropped: dict[int, list[int]]) -> tuple[int, int, int, int]:
    """The engine's rows for the kept assignments (only used with the no-drop table or the hand-worked drop case)."""
    if not dropped:
        return EXCHANGE[rank]
    # rank 1 drops 2 of expert 0's assignments: it sends 62 (48 away); rank 0's experts get 80 (48 from rank 1)
    return {0: (64, 32, 80, 48), 1: (62, 48, 46, 32)}[rank]


def model(with_fit: bool = True) -> TimeModel:
    fits = {("ep", "all_to_all"): LinkFit(ALPHA, BETA, (1024,))} if with_fit else {}
    return TimeModel(calibration=Calibration(kernels={}, rates={}, comm=CommModel(fits)))
