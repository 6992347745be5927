"""Context parallelism in the time model: the compute sweep times a CP rank's own work (the catalogue's entries,
common/ops: every per-token op at s/C tokens, core attention as ring attention's block kernels), the time model adds
a layer's attention up as C blocks (step 0 causal, C - 1 unmasked half blocks) beside the ring's exchanges, exposed
by max(0, transfer - block) each (ledger/models/formulas/ring_overlap.py exchange_exposed), and simulate prices the
same kernels from the hardware file.

The tiny preset (4 layers, 8 query heads, 4 KV heads, head dim 8, seq 32, fp32) at CP2, micro-batch 1: a rank holds
L = 16 tokens, |KV| = 2 x 4 B x 16 x 4 x 8 = 4,096 B, a block's attention 2 b h L^2 d = 32,768 FLOPs forward.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from common.arguments import parse_args
from ledger.models.simulate.calibration import hardware_calibration
from ledger.models.simulate.hardware import load_hardware
from ledger.models.time_model import (
    Calibration,
    CalibrationMissing,
    CommModel,
    ops,
    predict_step,
    stage_time,
)
from probes import compute_sweep
from tests.support.records import typed
from tests.support.ring_calibration import cp_send_recv_record
from tests.support.sweep_inputs import kernels, spec

CPU = torch.device("cpu")


def tiny(*flags: str, world: int = 2):
    return parse_args(["--model", "tiny", "--global-batch-size", "2", "--micro-batch-size", "1", *flags],
                      world_size=world)


CP2 = tiny("--context-parallel-size", "2")


# --- the sweep times a CP rank's ops ---------------------------------------------------------------------------------
def test_every_per_token_op_runs_at_the_cp_ranks_tokens_and_attention_at_the_rings_two_blocks():
    """CP2: 16 of the 32 tokens a rank; the causal diagonal 16 x 16, the half block 8 queries x 16 keys, both 32,768
    FLOPs forward (the diagonal's mask halves its 256 pairs, the half block has 128 unmasked), 2.5x backward."""
    planned = {p.op: p for p in compute_sweep.plan(spec(CP2, 0), CPU, kernels(CP2))}
    assert planned["embedding.fwd"].dims["tokens"] == planned["linear_qkv.fprop"].dims["m"] == 16
    assert planned["rope.fwd"].dims["seq"] == 16
    attention = [p for p in compute_sweep.plan(spec(CP2, 0), CPU, kernels(CP2))
                 if p.op.startswith("core_attention")]
    assert {(p.op, p.dims["queries"], p.dims["seq"], p.dims["causal"], p.flops) for p in attention} == {
        ("core_attention.fwd", 16, 16, 1, 32768.0), ("core_attention.bwd", 16, 16, 1, 81920.0),
        ("core_attention.fwd", 8, 16, 0, 32768.0), ("core_attention.bwd", 8, 16, 0, 81920.0)}


def test_a_cp_sweep_without_the_engines_block_kernels_is_refused():
    with pytest.raises(ValueError, match="EngineKernels.ring"):
        compute_sweep.plan(spec(CP2, 0), CPU, dataclasses.replace(kernels(CP2), ring=None))


@pytest.mark.parametrize("cfg", [CP2, tiny("--context-parallel-size", "4", "--bf16", world=4)], ids=["cp2", "cp4-bf16"])
def test_a_cp_sweep_calibrates_a_stages_passes(cfg, tmp_path, monkeypatch):
    """Plumbing on CPU: every planned op runs (the blocks, and the engine's ring loops with their blocks answered
    by precomputed results), and the sweep's own records (and a cp send_recv) price both passes with nothing
    missing, the ring's transfer included (4 layers' C - 1 forward messages of 100 us); a whole step also needs the
    DP collectives, which run over dp_cp."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    records = compute_sweep.run(spec(cfg, 0), CPU, kernels(cfg), warmup=0, iters=1)
    assert all(r["seconds"] > 0 for r in records)
    cal = Calibration.from_records(typed("compute", records),
                                   [cp_send_recv_record(cfg, 100e-6, units) for units in (1, 2)])
    chunk = stage_time(cfg, cal, 0).chunks[0]
    assert chunk.forward.seconds > 0 and chunk.backward.seconds > 0
    assert chunk.forward.cp_transfer == pytest.approx(4 * (cfg.parallel.context_parallel_size - 1) * 100e-6)
    with pytest.raises(CalibrationMissing, match="dp_cp"):
        predict_step(cfg, cal)


# --- a CP layer's time, by hand (plumbing: the calibration is made up) -----------------------------------------------
BLOCK_S = {("fwd", 1): 50e-6, ("fwd", 0): 30e-6, ("bwd", 1): 200e-6, ("bwd", 0): 80e-6}
MERGE_S = {"fwd": 10e-6, "bwd": 20e-6}


def synthetic(cfg) -> Calibration:
    """Every kernel free but the ring's blocks (BLOCK_S by pass and causal) and merges (MERGE_S a pass); a |KV|
    message takes 100 us."""
    def seconds(k: ops.Kernel) -> float:
        head, _, pass_ = k.name.rpartition(".")
        if head == "core_attention":
            return BLOCK_S[(pass_, dict(k.dims)["causal"])]
        return MERGE_S[pass_] if head == "ring_attention.merge" else 0.0

    kernels = {(k.name, k.dims, cfg.train.params_dtype): seconds(k) for k in ops.kernels(cfg, 0)}
    return Calibration(kernels=kernels, rates={}, comm=CommModel.from_sweep([cp_send_recv_record(cfg, 100e-6)]))


def test_a_cp2_layers_attention_is_its_two_blocks_plus_what_the_blocks_do_not_hide():
    """Forward, per layer: the causal block (50 us) beside a 100 us message (50 exposed), then the half block (30),
    then the merge (10): 140 us; 4 layers 560 us, 200 exposed of 400 sent. Backward: the half block (80) beside a
    100 us message (20 exposed), the causal block (200) beside another (none exposed), the accumulations (20):
    320 us; 4 layers 1,280, 80 exposed."""
    chunk = stage_time(CP2, synthetic(CP2), 0).chunks[0]
    assert chunk.forward.seconds == pytest.approx(560e-6)
    assert (chunk.forward.cp_exposed, chunk.forward.cp_transfer) == pytest.approx((200e-6, 400e-6))
    assert chunk.backward.seconds == pytest.approx(1280e-6)
    assert (chunk.backward.cp_exposed, chunk.backward.cp_transfer) == pytest.approx((80e-6, 800e-6))


def test_a_cp4_backward_pays_for_its_double_messages():
    """CP4 backward, per layer: messages |KV|, 2|KV|, 2|KV|, |KV| (100, 200, 200, 100 us) beside half, half, half,
    causal blocks (80, 80, 80, 200 us): exposed 20 + 120 + 120 + 0 = 260, blocks 440, accumulations 20: 720 us;
    4 layers 2,880 us. Forward: blocks 50 + 3 x 30, exposed 50 + 70 + 70, merges 10: 340 us; 4 layers 1,360 us."""
    cp4 = tiny("--context-parallel-size", "4", world=4)
    chunk = stage_time(cp4, synthetic(cp4), 0).chunks[0]
    assert chunk.backward.seconds == pytest.approx(2880e-6)
    assert chunk.backward.cp_exposed == pytest.approx(1040e-6)
    assert chunk.forward.seconds == pytest.approx(1360e-6)


# --- simulate prices the same kernels --------------------------------------------------------------------------------
def test_simulate_prices_a_cp_layouts_ring_blocks_from_the_hardware_file():
    """The hardware calibration holds every kernel of the CP layout (both blocks included) and predicts a step."""
    cfg = parse_args(["--model", "llama3.2-1b", "--context-parallel-size", "2", "--tensor-model-parallel-size", "4",
                      "--sequence-parallel", "--global-batch-size", "8", "--micro-batch-size", "1", "--bf16",
                      "--seq-length", "8192"], world_size=8)
    cal = hardware_calibration(cfg, load_hardware("H200"))
    blocks = {dict(k.dims)["causal"] for k in ops.kernels(cfg, 0) if k.name == "core_attention.fwd"}
    assert blocks == {0, 1}
    assert predict_step(cfg, cal).step_time > 0
