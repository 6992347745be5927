"""common/ops: the one catalogue of what a rank computes, which the time model lays out in passes and the compute sweep
times (tests/test_compute_sweep.py holds the sweep to it).

Held here: its FLOPs add up to Megatron's model FLOPs of a step (the ledger's formula, docs/formulas.md "FLOPs", and
the engine's num_floating_point_operations); the committed runs' sweeps recorded exactly its entries (real H200 and
gloo runs, so the records the time model reads are the catalogue's); the time model's passes use every entry and no
kernel of their own; every entry that is not a GEMM or core attention has its bytes moved.
"""
from __future__ import annotations

import json

import pytest

from common.arguments import parse_args
from common.config import RunConfig
from common.ops import (
    GEMM_PASSES,
    RATE_OPS,
    SUSTAINED,
    Linear,
    RankOps,
    Shapes,
    bytes_moved,
    rank_ops,
)
from common.ops.linear import GroupedLinear
from ledger.evidence.run import collect_run
from ledger.models.formulas.flops import megatron_flops_per_step
from ledger.models.formulas.params import num_chunks
from ledger.models.time_model import ops
from tests.support.recorded_runs import FIXTURES

TINY = "--model tiny --global-batch-size 8 --micro-batch-size 2"
GPT = "--num-layers 4 --hidden-size 256 --num-attention-heads 8 --vocab-size 1000 --seq-length 64 --bf16"
CONFIGS = {
    "dense": TINY,
    "tp2-sp": TINY + " --world-size 2 --tensor-model-parallel-size 2 --sequence-parallel",
    "pp2-vpp": TINY + " --world-size 2 --pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1",
    "cp2": TINY + " --world-size 2 --context-parallel-size 2",
    "cp4-tp2": TINY + " --world-size 8 --context-parallel-size 4 --tensor-model-parallel-size 2 --sequence-parallel",
    "moe-ep2": TINY + " --world-size 2 --num-experts 8 --moe-router-topk 3 --expert-model-parallel-size 2",
    "moe-grouped-gemm-ep2": TINY + " --world-size 2 --num-experts 8 --moe-router-topk 3 --expert-model-parallel-size 2"
                            " --moe-grouped-gemm",
    "moe-grouped-gemm": TINY + " --num-experts 4 --moe-grouped-gemm",
    "fused-loss-tp2-sp": TINY + " --world-size 2 --tensor-model-parallel-size 2 --sequence-parallel"
                         " --cross-entropy-loss-fusion --cross-entropy-fusion-impl linear",
    "llama3.2-1b-tp2": "--model llama3.2-1b --world-size 2 --tensor-model-parallel-size 2 --global-batch-size 4 --bf16",
    "gpt-tp2": GPT + " --world-size 2 --tensor-model-parallel-size 2 --global-batch-size 4",
}


def config(name: str) -> RunConfig:
    return parse_args(CONFIGS[name].split(), megatron_model=name.startswith("gpt"))


def last_stage(cfg: RunConfig) -> int:
    return cfg.parallel.pipeline_model_parallel_size - 1


def gemm_flops(linear: Linear | GroupedLinear, expert_rows: tuple[int, ...] = ()) -> float:
    """fprop, dgrad and wgrad, each counted (two of them can share dims, and so be one kernel); a grouped linear's
    wgrad once an expert, at its rows."""
    wgrads = [linear.wgrad(r) for r in expert_rows] if isinstance(linear, GroupedLinear) else [linear.wgrad]
    return linear.fprop.flops + linear.dgrad.flops + sum(w.flops for w in wgrads)


def layer_flops(rank: RankOps) -> float:
    """One layer, one micro-batch, one rank, in Megatron's convention: every GEMM's three passes (the router's left
    out, as Megatron leaves it), core attention's forward x 3 (Megatron counts its backward as twice the forward;
    flash attention's 2.5x, the catalogue's, is what runs). Under CP a pass runs C ring blocks: 1 causal, C - 1 half;
    an MoE layer runs each local expert at its rows (under --moe-grouped-gemm all of them in one grouped GEMM: with
    no capacity factor its rows are the kept ones)."""
    sh, layer = rank.shapes, rank.layer
    a = layer.attention
    if layer.moe is None:
        mlps = [layer.mlp]
    else:
        mlps = [layer.moe.grouped] if layer.moe.grouped else [layer.moe.expert(r) for r in sh.moe.rows if r > 0]
    rows = tuple(r for r in sh.moe.rows if r > 0) if layer.moe is not None else ()
    gemms = sum(gemm_flops(linear, rows) for linear in [a.qkv, a.proj] + [x for m in mlps for x in (m.fc1, m.fc2)])
    attention = a.core.fwd.flops if a.ring is None else a.ring.causal.fwd.flops + (sh.cp - 1) * a.ring.half.fwd.flops
    return gemms + 3 * attention


def step_flops(cfg: RunConfig) -> float:
    """Every layer and the logit GEMM, on every TP and CP rank of a micro-batch, over the global batch."""
    rank = rank_ops(Shapes.of(cfg), True, True)
    per_microbatch = cfg.model.num_layers * layer_flops(rank) + gemm_flops(rank.head.output_layer)
    p = cfg.parallel
    micro_batches = cfg.train.global_batch_size // cfg.train.micro_batch_size
    return per_microbatch * p.tensor_model_parallel_size * p.context_parallel_size * micro_batches


@pytest.mark.parametrize("name", CONFIGS)
def test_a_steps_catalogue_flops_are_megatrons_count(name):
    cfg = config(name)
    assert step_flops(cfg) == pytest.approx(megatron_flops_per_step(cfg), rel=1e-12)
    if cfg.model.llama_style:  # the engine's count is the Llama style's (SwiGLU)
        from engine.training import num_floating_point_operations  # torch
        assert step_flops(cfg) == pytest.approx(num_floating_point_operations(cfg, cfg.train.global_batch_size),
                                                rel=1e-12)


@pytest.mark.parametrize("name", CONFIGS)
def test_the_time_models_passes_price_exactly_the_catalogues_entries(name):
    cfg = config(name)
    for pp in range(cfg.parallel.pipeline_model_parallel_size):
        passes = [ops.chunk_forward(cfg, pp, c) + ops.chunk_backward(cfg, pp, c) for c in range(num_chunks(cfg))]
        walked = {w.op for work in passes for w in work if isinstance(w.op, ops.Kernel)}
        assert walked == set(rank_ops(Shapes.of(cfg), pp == 0, pp == last_stage(cfg)).kernels())


@pytest.mark.parametrize("name", CONFIGS)
def test_the_first_stage_embeds_the_last_runs_the_head_and_every_entry_not_a_gemm_or_attention_has_its_bytes(name):
    cfg = config(name)
    for pp in range(cfg.parallel.pipeline_model_parallel_size):
        rank = rank_ops(Shapes.of(cfg), pp == 0, pp == last_stage(cfg))
        assert (rank.embedding is not None, rank.head is not None) == (pp == 0, pp == last_stage(cfg))
        for k in rank.kernels():
            if k.name.rpartition(".")[2] not in GEMM_PASSES and not k.name.startswith("core_attention."):
                assert bytes_moved(k, 2, 4) > 0, k.describe()


def swept_runs() -> list:
    return [m.parent for m in sorted(FIXTURES.rglob("manifest.json"))
            if any('"compute"' in p.read_text() for p in m.parent.glob("ranks/*/events.jsonl"))]


@pytest.mark.parametrize("run", swept_runs(), ids=lambda p: str(p.relative_to(FIXTURES)))
def test_the_committed_sweeps_recorded_exactly_the_catalogues_entries(run):
    """Real runs (H200, gloo CPU): each rank's records are its stage's catalogue entries, op, dims, dtype and FLOPs,
    and the per-element work at its dtype; a record measured then (not read from the cache, which stores its JSON
    with sorted keys) lists its dims in the catalogue's declared order."""
    ev = collect_run(run)
    cfg = ev.config
    for r in ev.ranks.values():
        pp = r.coords["pp"]
        rank = rank_ops(Shapes.of(cfg), pp == 0, pp == last_stage(cfg))
        kernels = [x for x in r.compute if x.op not in RATE_OPS and x.op != SUSTAINED]
        assert sorted((x.op, sorted(x.dims.items()), x.dtype, x.flops) for x in kernels) == sorted(
            (k.name, sorted(k.dims), cfg.train.params_dtype, k.flops) for k in rank.kernels())
        assert {(x.op, x.dtype) for x in r.compute if x.op in RATE_OPS} == {
            (q.name, q.dtype) for q in rank.rates}
        declared = {(k.name, json.dumps(sorted(k.dims))): list(k.record_dims()) for k in rank.kernels()}
        assert all(list(x.dims) == declared[(x.op, json.dumps(sorted(x.dims.items())))]
                   for x in kernels if not x.cached)


@pytest.mark.parametrize("name", ["moe-grouped-gemm", "moe-grouped-gemm-ep2"])
def test_the_sustained_pass_runs_a_grouped_linears_forward_alone(name):
    """The sweep's sustained.layer record calls its kernels back to back with no autograd between them: a grouped
    linear's dgrad and wgrad exist only as the grouped GEMM's backward (they need its forward first), so the record
    holds the experts' fprops and none of their other passes; the attention's linears keep all three."""
    layer = rank_ops(Shapes.of(config(name)), True, True).layer
    sustained = set(layer.sustained())
    grouped = layer.moe.grouped
    assert {grouped.fc1.fprop, grouped.fc2.fprop} <= sustained
    assert not {grouped.fc1.dgrad, grouped.fc1.wgrad, grouped.fc2.dgrad, grouped.fc2.wgrad} & sustained
    assert set(layer.attention.qkv.kernels()) <= sustained
