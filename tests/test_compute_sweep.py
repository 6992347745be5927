"""probes/compute_sweep.py: the start-up sweep times exactly the ops the time model adds up, writes records the
calibration reads, and caches them per machine and shape.

CPU, tiny shapes: these test plumbing (which ops, which fields, which cache entry), not timings. The sweep's ops are
derived from its SweepSpec, the time model's from the RunConfig (ledger/models/time_model/ops.py), independently: a
kernel one side has and the other lacks is a prediction that cannot be made, or a measurement nobody uses.
"""
from __future__ import annotations

import functools

import pytest
import torch

from common.arguments import parse_args
from common.config import RunConfig
from engine.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from engine.tensor_parallel.layers import pad_vocab_size
from engine.tensor_parallel.mappings import TPGroup
from engine.transformer.attention import split_qkv_and_rotate
from engine.transformer.mlp import swiglu
from ledger.models.formulas.params import params_total
from ledger.models.time_model import Calibration, ops, predict_step, stage_time
from probes import compute_sweep
from probes.compute_sweep import EngineKernels, SweepSpec

CPU = torch.device("cpu")
# What a record carries (the module's docstring; the calibration reads op, dims, dtype, seconds).
FIELDS = {"op", "dims", "dtype", "seconds", "flops", "iters", "device", "threads", "variant", "cached"}


def engine_kernels(vocab_size: int) -> EngineKernels:
    """The engine's own fused functions, as engine/training.py hands them to the sweep (eager on CPU)."""
    return EngineKernels(split_qkv_and_rotate=split_qkv_and_rotate, swiglu=swiglu,
                         cross_entropy=functools.partial(vocab_parallel_cross_entropy,
                                                         tp=TPGroup(group=None, size=1, rank=0),
                                                         vocab_size=vocab_size),
                         variant="eager")


def spec(c: RunConfig, stage: int) -> SweepSpec:
    tp, p, m = c.parallel.tensor_model_parallel_size, c.parallel.pipeline_model_parallel_size, c.model
    numel = params_total(c)
    return SweepSpec.from_run(c, tp_size=tp, padded_vocab_size=pad_vocab_size(m.vocab_size,
                                                                              m.make_vocab_size_divisible_by, tp),
                              first_stage=stage == 0, last_stage=stage == p - 1, optimizer_numel=numel,
                              grad_buffer_numel=numel)


PIPELINED = ("--model tiny --num-layers 6 --world-size 6 --tensor-model-parallel-size 2 --sequence-parallel "
             "--pipeline-model-parallel-size 3 --global-batch-size 6 --bf16 --recompute-granularity selective")
SINGLE = "--model tiny --num-layers 2 --seq-length 16 --global-batch-size 2 --bf16"


@pytest.mark.parametrize("flags, stage", [(PIPELINED, 0), (PIPELINED, 1), (PIPELINED, 2), (SINGLE, 0),
                                          (SINGLE.replace("--bf16", "--untie-embeddings-and-output-weights"), 0),
                                          (PIPELINED + " --cross-entropy-loss-fusion --cross-entropy-fusion-impl "
                                                       "linear", 2)],
                         ids=["first", "middle", "last", "single", "single-untied-fp32", "last-fused-loss"])
def test_the_sweep_plans_the_time_models_kernels_with_their_dims_and_flops(flags, stage):
    c = parse_args(flags.split())
    planned = compute_sweep.plan(spec(c, stage), CPU, engine_kernels(c.model.vocab_size))
    swept = {(p.op, tuple(sorted(p.dims.items())), p.flops) for p in planned if p.op not in ops.RATE_OPS}
    modelled = {(k.name, k.dims, k.flops) for k in ops.kernels(c, stage)}
    assert swept == modelled
    assert {p.dtype for p in planned if p.op not in ops.RATE_OPS} == {c.train.params_dtype}
    # the per-element rates, at the dtypes the step looks them up with
    assert {(p.op, p.dtype) for p in planned if p.op in ops.RATE_OPS} == {
        ("optimizer.step", c.train.params_dtype), ("grad_buffer.zero", c.train.grad_dtype)}
    ends = {p.op.split(".")[0] for p in planned} & {"embedding", "output_layer", "cross_entropy"}
    assert ends == ({"embedding"} if stage == 0 else set()) | (
        {"output_layer", "cross_entropy"} if stage == c.parallel.pipeline_model_parallel_size - 1 else set())


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "train-ledger" / "compute"


def sweep(c: RunConfig, use_cache: bool = True) -> list[dict]:
    return compute_sweep.run(spec(c, 0), CPU, engine_kernels(c.model.vocab_size), use_cache=use_cache, warmup=1,
                             iters=2)


def test_records_carry_the_documented_fields_and_calibrate_a_whole_step(cache):
    c = parse_args(SINGLE.split())
    records = sweep(c)
    assert all(set(r) == FIELDS for r in records)
    assert all(r["seconds"] > 0 and r["iters"] == 2 and r["variant"] == "eager" and not r["cached"] for r in records)
    assert {r["op"] for r in records} >= set(ops.RATE_OPS)
    cal = Calibration.from_records(records, [])
    assert cal.sustained == 1.0  # the power-limit record is GPU only
    assert stage_time(c, cal, 0).forward > 0
    assert predict_step(c, cal).step_time > 0  # one rank: no link needed


def test_a_second_run_of_the_same_shapes_reads_the_cache_and_no_cache_measures_again(cache):
    c = parse_args(SINGLE.split())
    first = sweep(c)
    assert len(list(cache.glob("*.json"))) == 1
    again = sweep(c)
    assert all(r["cached"] for r in again)
    assert [(r["op"], r["seconds"]) for r in again] == [(r["op"], r["seconds"]) for r in first]
    fresh = sweep(c, use_cache=False)
    assert not any(r["cached"] for r in fresh)
    refreshed = sweep(c)  # --no-compute-sweep-cache measured anew and rewrote the entry
    assert all(r["cached"] for r in refreshed)
    assert [r["seconds"] for r in refreshed] == [r["seconds"] for r in fresh]


def test_other_shapes_are_measured_not_read_from_anothers_cache_entry(cache):
    sweep(parse_args(SINGLE.split()))
    longer = sweep(parse_args(SINGLE.replace("--seq-length 16", "--seq-length 32").split()))
    assert not any(r["cached"] for r in longer)
    assert len(list(cache.glob("*.json"))) == 2


def test_a_cache_that_cannot_be_written_costs_a_measurement_not_the_run(tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # the cache folder would sit under a file
    records = sweep(parse_args(SINGLE.split()))
    assert records and not any(r["cached"] for r in records)
