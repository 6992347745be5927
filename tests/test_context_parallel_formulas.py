"""Context parallelism in the ledger (issue 19, section 1): plan, simulate and search model --context-parallel-size C
(the engine runs it: tests/test_context_parallel.py). Expectations are derived by hand from Megatron's rules
(docs/formulas.md, "Context parallel"): each CP rank holds s/C tokens (chunks i and 2C-1-i of 2C), Transformer
Engine's ring attention sends the local K/V blocks around the CP group (C - 1 messages forward; K/V and dK/dV,
2 (C - 1) blocks in C messages, backward), and the gradients are reduced, and the distributed optimizer sharded,
over the dp x cp ranks.
The time-model checks run on a synthetic calibration (round kernel prices by name, hand-set link fits): plumbing and
arithmetic, not a device.
"""
from __future__ import annotations

import dataclasses
import json

import pytest

from cli.main import main as cli_main
from common.arguments import parse_args
from common.config import RunConfig
from common.errors import ConfigError
from ledger.models.formulas import activations, comm
from ledger.models.formulas.bytes_per_param import run_bytes_per_param
from ledger.models.formulas.static_memory import static_bytes_per_stage
from ledger.models.time_model import (
    Calibration,
    CommModel,
    LinkFit,
    ops,
    predict_step,
    stage_time,
)
from tests.support.records import typed

MS = 1e-3


def cfg(*flags: str, megatron_model: bool = False) -> RunConfig:
    return parse_args(list(flags), megatron_model=megatron_model)


def tiny(world: int, cp: int, *flags: str) -> RunConfig:
    return cfg("--model", "tiny", "--bf16", "--world-size", str(world), "--context-parallel-size", str(cp), *flags)


def llama_1b(world: int, cp: int, *flags: str) -> RunConfig:
    return cfg("--model", "llama3.2-1b", "--bf16", "--seq-length", "8192", "--world-size", str(world),
               "--context-parallel-size", str(cp), *flags)


# ---- activations: s / C tokens per rank ----------------------------------------------------------------------------

# tiny in bf16 (h 64, f 176, 8 heads of 8, 4 query groups: k and v 32 wide, vocab 1000), per token of one layer:
# norm inputs, qkv and fc1 inputs, q, attention output: 6 x 2 x 64 = 768; k, v: 2 x 2 x 32 = 128; two fp32 rstd: 8;
# logsumexp, fp32 per head: 4 x 8 = 32; SwiGLU's input (gate and up): 2 x 2 x 176 = 704; fc2's input: 2 x 176 = 352.
TINY_LAYER_BYTES_PER_TOKEN = 768 + 128 + 8 + 32 + 704 + 352  # 1,992
# One stage (PP 1) also holds the token ids (8), the final norm's input and rstd (128 + 4), the output layer's input
# (128), and what the loss saves: the 16-bit logits over the vocabulary (2 x 1000), the fp32 max and sum of
# exponentials (4 + 4) it recomputes the softmax from, and its mask and targets (1 + 8).
TINY_EXTRAS_PER_TOKEN = 8 + 128 + 4 + 128 + 2000 + 8 + 9


def test_tiny_activations_per_rank_at_cp2_are_the_hand_counted_half_of_cp1():
    one, two = tiny(1, 1), tiny(2, 2)  # seq 32: 32 tokens on the one rank, 16 on each CP rank
    assert activations.layer_bytes(one) == 32 * TINY_LAYER_BYTES_PER_TOKEN == 63_744
    assert activations.layer_bytes(two) == 16 * TINY_LAYER_BYTES_PER_TOKEN == 31_872
    halves = {name: n // 2 for name, n in activations.layer_saved_tensors(one).items()}
    assert activations.layer_saved_tensors(two) == halves  # every tensor, the attention's and logsumexp included
    assert activations.stage_activation_bytes(two, 0) == 16 * (4 * TINY_LAYER_BYTES_PER_TOKEN
                                                               + TINY_EXTRAS_PER_TOKEN) == 164_048


def test_cp_and_sequence_parallel_split_the_sequence_twice():
    """TP 2 with SP on CP 2: the [s, b, h] tensors outside the TP regions hold s / (C t) tokens."""
    one = tiny(2, 1, "--tensor-model-parallel-size", "2", "--sequence-parallel")
    two = tiny(4, 2, "--tensor-model-parallel-size", "2", "--sequence-parallel")
    assert activations.layer_saved_tensors(two) == {k: n // 2 for k, n in activations.layer_saved_tensors(one).items()}


def test_the_sequence_must_split_into_2c_chunks():
    with pytest.raises(ConfigError, match="not divisible by 2 x --context-parallel-size 3"):
        tiny(3, 3)  # 32 tokens into 6 chunks
    with pytest.raises(ConfigError, match="--sequence-parallel"):
        # 36 tokens split into 4 chunks, but each rank's 18 do not split over TP 4
        cfg("--model", "tiny", "--seq-length", "36", "--max-position-embeddings", "64", "--world-size", "8",
            "--context-parallel-size", "2", "--tensor-model-parallel-size", "4", "--sequence-parallel")


# ---- the K/V ring's volume -----------------------------------------------------------------------------------------

# llama3.2-1b at seq 8192 on CP 2, bf16: each rank's K and V blocks are [4096, 1, 8 query groups, 64] each, so
# |KV| = 2 x 4096 x 8 x 64 x 2 B = 8 MiB a layer.
KV_BLOCK = 2 * (8192 // 2) * 1 * 8 * 64 * 2


def test_kv_ring_bytes_per_step_for_llama_1b_at_8k_on_cp2():
    c = llama_1b(2, 2)  # dp 1, one micro-batch
    assert comm.kv_block_bytes(c) == KV_BLOCK == 8_388_608
    coll = comm.step_collectives(c, 0)
    for direction in ("send", "recv"):
        forward = coll[f"cp.{direction}.kv_forward[bf16]"]
        backward = coll[f"cp.{direction}.kv_dkv_backward[bf16]"]
        # forward: 16 layers x (C - 1) K/V blocks
        assert (forward.calls, forward.size_bytes) == (16, 16 * 1 * KV_BLOCK) == (16, 134_217_728)
        # backward: per layer the K/V block (step 0) then the dK/dV partial sums (step 1): 2 (C - 1) blocks, C messages
        assert (backward.calls, backward.size_bytes) == (16 * 2, 16 * 2 * KV_BLOCK) == (32, 268_435_456)
        assert forward.group_size == 2 and forward.bytes_per_rank == forward.size_bytes  # send/recv: bus factor 1
    assert not any(".kv_recompute" in name for name in coll)  # no recompute: nothing re-sent


@pytest.mark.parametrize("cp, forward, backward", [
    (2, [1], [1, 1]),
    (4, [1, 1, 1], [1, 2, 2, 1]),  # the middle steps send K/V and dK/dV in one buffer
])
def test_ring_messages_are_c_minus_1_forward_and_2_c_minus_1_blocks_in_c_messages_backward(cp, forward, backward):
    assert comm.ring_messages(cp, forward=True) == forward
    assert comm.ring_messages(cp, forward=False) == backward
    assert sum(backward) == 2 * (cp - 1)


def test_selective_recompute_resends_the_forward_ring_and_no_cp_sends_nothing():
    c = llama_1b(2, 2, "--recompute-granularity", "selective")
    coll = comm.step_collectives(c, 0)
    assert coll["cp.send.kv_recompute[bf16]"].size_bytes == coll["cp.send.kv_forward[bf16]"].size_bytes
    assert not any(name.startswith("cp.") for name in comm.step_collectives(llama_1b(2, 1), 0))


# ---- gradients over dp x cp -----------------------------------------------------------------------------------------

def test_static_bytes_of_cp2_x_dp2_with_the_distributed_optimizer_equal_dp4():
    """The distributed optimizer shards over Megatron's dp_cp group: 4 ranks either way, whatever splits them."""
    flags = ("--use-distributed-optimizer", "--overlap-grad-reduce", "--global-batch-size", "8")
    cp2_dp2, dp4, dp2 = llama_1b(4, 2, *flags), llama_1b(4, 1, *flags), llama_1b(2, 1, *flags)
    assert static_bytes_per_stage(cp2_dp2) == static_bytes_per_stage(dp4)
    assert static_bytes_per_stage(cp2_dp2) != static_bytes_per_stage(dp2)  # what sharding over dp alone would give
    assert run_bytes_per_param(cp2_dp2).total == run_bytes_per_param(dp4).total == 2 + 4 + 12 / 4  # Megatron's table
    rs = comm.step_collectives(cp2_dp2, 0)["dp_cp.reduce_scatter.grads[fp32]"]
    assert rs.group_size == 4
    assert rs.bytes_per_rank == comm.step_collectives(dp4, 0)["dp.reduce_scatter.grads[fp32]"].bytes_per_rank


# ---- the time model: C attention blocks, the ring's exposed excess, DP over dp_cp ---------------------------------

PRICE_MS = {"core_attention.fwd": 0.3, "core_attention.bwd": 0.7}  # every other kernel 0.01 ms


def price(name: str) -> float:
    return PRICE_MS.get(name, 0.01) * MS


def calibration(c: RunConfig, fits: dict) -> Calibration:
    records = [{"op": k.name, "dims": dict(k.dims), "dtype": c.train.params_dtype, "seconds": price(k.name)}
               for s in range(c.parallel.pipeline_model_parallel_size) for k in ops.kernels(c, s)]
    records += [{"op": op, "dims": {"numel": 1000}, "dtype": dtype, "seconds": 1e-6}
                for op, dtype in (("optimizer.step", c.train.params_dtype), ("grad_buffer.zero", c.train.grad_dtype))]
    return dataclasses.replace(Calibration.from_records(typed("compute", records), []), comm=CommModel(fits))


def ring(alpha: float) -> dict:
    """The cp ring's link at a latency of alpha; the dp_cp group's (CP 2 at DP 1 still reduces over 2) free."""
    free = LinkFit(0.0, 0.0, (1,))
    return {("cp", "send_recv"): LinkFit(alpha, 0.0, (1,)),
            **{("dp_cp", kind): free for kind in ("all_reduce", "reduce_scatter", "all_gather")}}


def test_attention_runs_c_blocks_at_s_over_c_beside_its_ring_messages():
    c = tiny(4, 4, "--num-layers", "1")
    forward = ops.chunk_forward(c, 0, 0)
    blocks = [w.op for w in forward if isinstance(w.op, ops.Kernel) and w.op.name == "core_attention.fwd"]
    assert len(blocks) == 4 and all(dict(k.dims)["seq"] == 32 // 4 for k in blocks)
    kv = 2 * 2 * 8 * 1 * 4 * 8  # K and V, bf16, 8 tokens, 4 query groups of 8
    sends = [w.op.size_bytes for w in forward if isinstance(w.op, ops.Collective) and w.op.group == "cp"]
    assert sends == [kv] * 3
    backward = ops.chunk_backward(c, 0, 0)
    assert [w.op.size_bytes for w in backward if isinstance(w.op, ops.Collective) and w.op.group == "cp"] == [
        kv, 2 * kv, 2 * kv, kv]


@pytest.mark.parametrize("alpha_ms, forward_exposed_ms, backward_exposed_ms", [
    (0.2, 0.0, 0.0),  # shorter than either block: all hidden
    (0.5, 0.2, 0.0),  # beyond the forward block (0.3 ms) by 0.2, inside the backward one (0.7 ms)
    (1.0, 0.7, 2 * 0.3),  # beyond both: the forward's one message, the backward's two
])
def test_a_ring_message_exposes_only_what_outlasts_its_block(alpha_ms, forward_exposed_ms, backward_exposed_ms):
    c = tiny(2, 2, "--num-layers", "1", "--global-batch-size", "3")
    cal = calibration(c, ring(alpha_ms * MS))
    t = stage_time(c, cal, 0).chunks[0]
    hidden = stage_time(c, calibration(c, ring(0.0)), 0).chunks[0]
    assert t.forward.cp_exposed == pytest.approx(forward_exposed_ms * MS)
    assert t.backward.cp_exposed == pytest.approx(backward_exposed_ms * MS)
    assert t.forward.seconds - hidden.forward.seconds == pytest.approx(forward_exposed_ms * MS)
    assert (t.forward.cp_transfer, t.backward.cp_transfer) == pytest.approx((alpha_ms * MS, 2 * alpha_ms * MS))
    m = 3
    assert predict_step(c, cal).stages[0].exposed["cp"] == pytest.approx(
        m * (forward_exposed_ms + backward_exposed_ms) * MS)


def test_grad_buckets_are_reduced_over_dp_x_cp():
    alpha, beta = 20e-6, 1e-9
    c = tiny(4, 2, "--use-distributed-optimizer", "--global-batch-size", "2")
    fits = {**ring(0.0), ("dp_cp", "reduce_scatter"): LinkFit(alpha, beta, (1,)),
            ("dp_cp", "all_gather"): LinkFit(alpha, beta, (1,)), ("dp_cp", "all_reduce"): LinkFit(alpha, 0.0, (1,))}
    prediction = predict_step(c, calibration(c, fits))  # no ("dp", ...) fit: the DP collectives must ask dp_cp's
    (grads,) = [b for b in prediction.buckets if b.op == "reduce_scatter"]
    assert grads.end - grads.start == pytest.approx(alpha + beta * grads.size_bytes * 3 / 4)  # over 4 ranks


# ---- the commands ----------------------------------------------------------------------------------------------------

def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = cli_main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_simulate_places_a_cp_group_and_halves_the_activations(capsys):
    base = ("simulate", "--model", "llama3.2-1b", "--bf16", "--seq-length", "8192", "--global-batch-size", "1",
            "--hardware", "H200", "--json")
    code, out, err = run(capsys, *base, "--world-size", "2", "--context-parallel-size", "2")
    assert code == 0, err
    two = json.loads(out)
    code, out, err = run(capsys, *base, "--world-size", "1")
    assert code == 0, err
    one = json.loads(out)
    assert two["groups"]["cp"]["size"] == 2 and "cp" not in one["groups"]
    assert two["groups"]["dp_cp"]["size"] == 2
    assert two["memory"]["per_stage"][0]["activations"] * 2 == one["memory"]["per_stage"][0]["activations"]
    assert "cp" in two["step"]["per_stage"][0]["exposed_comm_s"]


def test_train_refuses_a_sequence_that_does_not_split_into_2cp_chunks_in_one_line(capsys):
    """The engine runs CP now (tests/test_context_parallel.py); a layout it cannot cut is still one line, exit 2,
    before any rank starts: tiny's 32 tokens are not 2 x 3 chunks."""
    code, out, err = run(capsys, "train", "--nproc-per-node", "3", "--model", "tiny", "--context-parallel-size", "3")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "not divisible by 2 x --context-parallel-size 3" in err


def test_plan_names_cp_and_search_keeps_the_cp_it_is_given(capsys):
    code, out, err = run(capsys, "plan", "--model", "llama3.2-1b", "--world-size", "4", "--context-parallel-size", "2",
                         "--bf16", "--seq-length", "8192")
    assert code == 0, err
    assert "world 4 = tp 1 x pp 1 x cp 2 x dp 2" in out
    code, out, err = run(capsys, "search", "--model", "llama3.2-1b", "--gpus", "16", "--hardware", "H200",
                         "--global-batch-size", "32", "--seq-length", "16384", "--max-position-embeddings", "16384",
                         "--bf16", "--context-parallel-size", "2", "--top", "2", "--json")
    assert code == 0, err
    top = json.loads(out)["top"]
    assert top and all("cp2" in e["label"] and e["layout"]["dp"] * e["layout"]["tp"] * e["layout"]["pp"] == 8
                       for e in top)
