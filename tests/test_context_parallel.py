"""Context parallelism: the load-balanced split, ring attention against whole-sequence causal attention, parity with
one process on gloo, and the ledger's view of a CP run.

Ring attention is first checked without a process group (tests.support.ring: C threads run the engine's own
ring_forward / ring_backward through in-process mailboxes), so the test exercises the real message protocol and can
count the messages against the ledger's formula.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.context_parallel import (
    cp_chunk_ids,
    cp_positions,
    get_batch_on_this_cp_rank,
)
from ledger.models.formulas.comm import ring_messages
from tests.support.ring import simulate_ring


# --- the split ------------------------------------------------------------------------------------------------------
def test_cp2_ranks_hold_chunks_0_3_and_1_2():
    assert [cp_chunk_ids(2, r) for r in (0, 1)] == [(0, 3), (1, 2)]
    # 8 tokens in 4 chunks of 2: rank 0 holds positions 0 1 | 6 7, rank 1 holds 2 3 | 4 5
    assert cp_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert cp_positions(8, 2, 1).tolist() == [2, 3, 4, 5]


def test_every_token_is_on_exactly_one_cp_rank_and_keeps_its_label():
    tokens = torch.arange(2 * 25).view(2, 25)  # [b, s + 1]: inputs and, shifted by one, labels
    for cp in (1, 2, 3):
        seq = 24
        held = [get_batch_on_this_cp_rank(tokens[:, :-1], cp, r) for r in range(cp)]
        labels = [get_batch_on_this_cp_rank(tokens[:, 1:], cp, r) for r in range(cp)]
        assert sorted(torch.cat(held, dim=1)[0].tolist()) == list(range(seq))
        for t, lab in zip(held, labels):
            assert torch.equal(lab, t + 1)  # the next token, whatever chunk it sits in
            assert t.shape == (2, seq // cp)


def test_each_cp_rank_gets_the_same_causal_work():
    """Keys visible to a rank's queries: equal over ranks, the reason for the 2C-chunk split."""
    s, cp = 24, 3
    work = [sum(int(p) + 1 for p in cp_positions(s, cp, r)) for r in range(cp)]
    assert len(set(work)) == 1


# --- ring attention in one process (tests.support.ring) ------------------------------------------------------------
@pytest.mark.parametrize("cp", [2, 3])
def test_ring_attention_equals_whole_sequence_causal_attention(cp):
    """GQA (8 query heads over 2 KV heads), fp64 so that only the algorithm, not rounding, could differ."""
    torch.manual_seed(0)
    b, hq, hkv, s, d = 2, 8, 2, 12 * cp, 16
    q = torch.randn(b, hq, s, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(b, hkv, s, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(b, hkv, s, d, dtype=torch.float64, requires_grad=True)
    dout = torch.randn(b, hq, s, d, dtype=torch.float64)
    expected = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    expected.backward(dout)
    results, _, _ = simulate_ring(q.detach(), k.detach(), v.detach(), dout, cp)
    for r, (out, dq, dk, dv) in results.items():
        mine = lambda t: get_batch_on_this_cp_rank(t, cp, r, dim=2)  # noqa: E731
        torch.testing.assert_close(out.double(), mine(expected.detach()), msg=lambda m: f"rank {r} out: {m}")
        torch.testing.assert_close(dq.double(), mine(q.grad), msg=lambda m: f"rank {r} dq: {m}")
        torch.testing.assert_close(dk.double(), mine(k.grad), msg=lambda m: f"rank {r} dk: {m}")
        torch.testing.assert_close(dv.double(), mine(v.grad), msg=lambda m: f"rank {r} dv: {m}")


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_ring_sends_the_messages_the_ledger_predicts(cp):
    """Per rank per layer: forward C - 1 K/V blocks; backward C messages, K/V, then K/V with dK/dV, then dK/dV
    (ledger.models.formulas.comm.ring_messages, in |KV| units: a message of 2 tensors [k, v] or [dk, dv] is one)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 4 * cp, 8, dtype=torch.float64) for _ in range(3))
    _, forward, backward = simulate_ring(q, k, v, torch.randn_like(q), cp)
    for r in range(cp):
        assert [n // 2 for _, n in forward[r]] == ring_messages(cp, forward=True)
        assert [n // 2 for _, n in backward[r]] == ring_messages(cp, forward=False)


# --- parity with one process (gloo, fp32) ---------------------------------------------------------------------------
CLIP = 0.05
BASE = ["--model", "tiny", "--num-layers", "2", "--micro-batch-size", "1", "--global-batch-size", "4",
        "--train-iters", "3", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "2",
        "--clip-grad", str(CLIP), "--mock-data"]
LAYOUTS = {
    # selective recompute: the checkpoint around core attention re-runs the forward ring in backward
    "cp2-selective": (2, ["--context-parallel-size", "2", "--recompute-granularity", "selective"]),
    "cp2-tp2-sp": (4, ["--context-parallel-size", "2", "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
}


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_context_parallel_run_equals_single_process(layout):
    from tests.support.gloo import run_distributed
    from tests.support.parity import (
        assert_rank_matches,
        flag_value,
        reference,
        train_rank,
    )

    world, flags = LAYOUTS[layout]
    results = run_distributed(train_rank, world, BASE + flags)
    ref = reference(tuple(BASE), flag_value(flags, "--tensor-model-parallel-size"))
    assert min(ref["grad_norms"]) > CLIP, "clipping must be active on every step"
    for rank, res in enumerate(results):
        assert res["params"].keys() == ref["params"].keys()
        assert_rank_matches(res, ref, rank, rtol=1e-5, atol=1e-6)


# --- the ledger's view of a CP run, as a user runs it ---------------------------------------------------------------
def test_a_traces_groupless_point_to_point_is_the_rings_under_cp_without_pp():
    """Traced send/recv ops record no ranks (NCCL's SendRecv kernels, gloo's c10d ops): without pipelining the only
    point-to-point traffic is ring attention's, so the trace's volume is compared with the cp row, not a pp row."""
    from common.arguments import parse_args
    from ledger.reconcile.comm import p2p_group

    def cfg(*flags):
        return parse_args(["--model", "tiny", *flags], world_size=4)

    assert p2p_group(cfg("--context-parallel-size", "2")) == "cp"
    assert p2p_group(cfg("--pipeline-model-parallel-size", "2")) == "pp"
    assert p2p_group(cfg("--context-parallel-size", "2", "--pipeline-model-parallel-size", "2")) == "pp"



@pytest.mark.slow
def test_a_cp2_run_reconciles_its_ring_volume_and_can_be_off(cp2_run, tmp_path):
    """The engine's cp-comm counters against cp_collectives: per rank per step, tiny (4 layers, 4 KV heads of 8,
    fp32) at s/C = 16: |KV| = 2 x 16 x 4 x 8 x 4 B = 4 KiB; per layer per micro-batch 1 forward and 2 backward
    messages, each counted sent + received: 3 x 2 x 4 KiB x 4 layers x 2 micro-batches = 192 KiB."""
    from cli.main import main as cli
    from ledger.evidence.read import read_run
    from ledger.reconcile.comm import volume_rows
    from ledger.reconcile.run import reconcile

    assert cli(["reconcile", str(cp2_run), "--out", str(tmp_path)]) == 0
    rows = [r for r in reconcile(cp2_run).rows if r.metric == "comm.cp.send_recv.bytes_per_step"]
    assert [(r.rank, r.predicted, r.inventory, r.verdict) for r in rows] == [
        (rank, 192 * 1024, 192 * 1024, "ok") for rank in (0, 1)]
    ev = read_run(cp2_run)
    for t in ev.ranks[0].timing:
        if t.category == "cp-comm":
            t.bytes *= 2  # the engine sending twice what the formula says
    (wrong,) = [r for r in volume_rows(ev.config, ev.ranks[0], None) if r.metric == "comm.cp.send_recv.bytes_per_step"]
    assert wrong.verdict == "off"
