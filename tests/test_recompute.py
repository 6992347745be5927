"""Activation recompute (Megatron's --recompute-granularity, --recompute-method, --recompute-num-layers): the flag
rules, what autograd really keeps under each mode against the ledger's formula, parity with the run without
recompute, the TP collectives recompute repeats against the ledger's count, and the peak row's mode.

The bytes test is the independent check of ledger/models/formulas/activations.py: on CPU in fp32 it counts every
distinct storage autograd saves while one model chunk of 4 tiny layers runs forward (saved_tensors_hooks also see what a
non-reentrant checkpoint keeps: its inputs), parameters and the shared RoPE tables left out.
"""
from __future__ import annotations

import contextlib
import subprocess
import sys
from collections import defaultdict

import pytest
import torch

from cli.plan import render
from common.arguments import parse_args
from common.config import RecomputeConfig, RunConfig
from common.events import ALLOCATED, PEAK
from engine.tensor_parallel.mappings import TPGroup
from engine.transformer.rotary import RotaryEmbedding
from engine.transformer.transformer_block import TransformerBlock, recompute_segments
from ledger.evidence.run import RankEvidence
from ledger.evidence.traces import normalize_op
from ledger.models.formulas import activations
from ledger.models.formulas.comm import tp_collectives
from ledger.models.formulas.peak_phases import peak_phase
from ledger.models.formulas.static_memory import static_bytes
from ledger.models.plan import build_plan
from ledger.reconcile.memory import rank_rows
from probes.probe_set import NullProbeSet
from tests.support.gloo import run_distributed
from tests.support.parity import (
    assert_close_rel,
    flag_value,
    reference,
    train_and_collect,
)
from tests.support.records import typed


def _recompute(granularity: str, method: str | None = None, layers: int | None = None) -> list[str]:
    flags = ["--recompute-granularity", granularity]
    if method is not None:
        flags += ["--recompute-method", method]
    if layers is not None:
        flags += ["--recompute-num-layers", str(layers)]
    return flags


# ---- flags --------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("flags, needle", [
    (["--recompute-method", "uniform"], "--recompute-method needs --recompute-granularity full"),
    (["--recompute-num-layers", "1"], "--recompute-num-layers needs --recompute-granularity full"),
    (_recompute("full"), "--recompute-granularity full needs --recompute-method"),
    (_recompute("full", "block"), "--recompute-granularity full needs --recompute-num-layers"),
    (_recompute("full", "uniform", 0), "--recompute-num-layers must be >= 1, got 0"),
    (_recompute("selective", "uniform"), "--recompute-method needs --recompute-granularity full (selective"),
    (_recompute("selective", layers=1), "--recompute-num-layers needs --recompute-granularity full (selective"),
    (["--recompute-granularity", "partial"], "invalid choice: 'partial'"),
    (_recompute("full", "chunked", 1), "invalid choice: 'chunked'"),
])
def test_bad_recompute_flags_are_one_line_and_status_2(flags, needle):
    out = subprocess.run([sys.executable, "-m", "cli.main", "plan", "--model", "tiny", *flags], capture_output=True,
                         text=True, timeout=60)
    assert (out.returncode, out.stdout) == (2, "")
    assert len(out.stderr.strip().splitlines()) == 1 and needle in out.stderr, out.stderr


def test_good_flags_and_older_manifests():
    cfg = parse_args(["--model", "tiny", *_recompute("full", "block", 9)])   # above the chunk's layers: accepted
    assert cfg.recompute == RecomputeConfig("full", "block", 9)
    assert RunConfig.from_dict(cfg.to_dict()).recompute == cfg.recompute
    manifest = cfg.to_dict()
    del manifest["recompute"]                                               # written before recompute existed
    assert RunConfig.from_dict(manifest).recompute == RecomputeConfig()


def test_layers_are_cut_as_megatron_cuts_them():
    assert recompute_segments(5, RecomputeConfig()) == [(0, 5, False)]
    assert recompute_segments(5, RecomputeConfig("selective")) == [(0, 5, False)]
    assert recompute_segments(5, RecomputeConfig("full", "uniform", 2)) == [(0, 2, True), (2, 4, True), (4, 5, True)]
    assert recompute_segments(5, RecomputeConfig("full", "block", 2)) == [(0, 1, True), (1, 2, True), (2, 5, False)]
    assert recompute_segments(5, RecomputeConfig("full", "block", 9)) == [(i, i + 1, True) for i in range(5)]


# ---- what autograd keeps ------------------------------------------------------------------------------------------

S, B, LAYERS = 32, 2, 4
MODES = {  # flags, and how many of the 4 layers run outside a full-recompute checkpoint
    "none": ([], 4),
    "selective": (_recompute("selective"), 4),
    "full uniform 1": (_recompute("full", "uniform", 1), 0),
    "full uniform 3": (_recompute("full", "uniform", 3), 0),   # groups of 3 and 1
    "full block 1": (_recompute("full", "block", 1), 3),
    "full block 4": (_recompute("full", "block", 4), 0),
}


def _config(flags: list[str]) -> RunConfig:
    return parse_args(["--model", "tiny", "--num-layers", str(LAYERS), "--micro-batch-size", str(B), *flags])


def _chunk(cfg: RunConfig) -> tuple[TransformerBlock, torch.Tensor, torch.Tensor]:
    block = TransformerBlock(cfg.model, list(range(LAYERS)), post_process=False, tp=TPGroup(None, 1, 0),
                             sequence_parallel=False, params_dtype=torch.float32, device="cpu", seed=3,
                             recompute=cfg.recompute)
    cos, sin = RotaryEmbedding(cfg.model.head_dim, cfg.model.rotary_base)(S, torch.device("cpu"), torch.float32)
    return block, cos, sin


def _saved_bytes(block: TransformerBlock, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> int:
    """Bytes of the distinct storages autograd saves in block's forward, leaving out the parameters and the RoPE
    tables (shared by every layer and step, not activations)."""
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        block(x, cos, sin)
    shared = {p.untyped_storage().data_ptr() for p in block.parameters()} | {
        cos.untyped_storage().data_ptr(), sin.untyped_storage().data_ptr()}
    return sum(n for ptr, n in saved.items() if ptr not in shared)


@pytest.mark.parametrize("mode", list(MODES))
def test_saved_bytes_per_mode_match_the_ledger_to_the_byte(mode):
    flags, plain_layers = MODES[mode]
    cfg = _config(flags)
    block, cos, sin = _chunk(cfg)
    x = torch.randn(S, B, cfg.model.hidden_size, requires_grad=True)
    h, f, a = cfg.model.hidden_size, cfg.model.ffn_hidden_size, 4
    # The ledger counts fused kernels (GPU). Eager on CPU, each RMSNorm also keeps x * rstd ([s, b, h]) and SwiGLU
    # keeps silu(gate) ([s, b, f]): a layer outside a checkpoint saves that much more here.
    eager_extra = a * S * B * (2 * h + f)
    expected = activations.chunk_activation_bytes(cfg, 0, 0).saved + plain_layers * eager_extra
    assert _saved_bytes(block, x, cos, sin) == expected


@pytest.mark.parametrize("mode", [m for m in MODES if m != "none"])
def test_recompute_changes_no_gradient(mode):
    grads = []
    for flags in (MODES[mode][0], []):
        cfg = _config(flags)
        block, cos, sin = _chunk(cfg)
        x = torch.randn(S, B, cfg.model.hidden_size, generator=torch.Generator().manual_seed(5), requires_grad=True)
        out = block(x, cos, sin)
        (out * out).sum().backward()
        grads.append([x.grad, *(p.grad for p in block.parameters())])
    for got, want in zip(*grads):
        assert_close_rel(got, want, "gradient")


# ---- training parity and the TP collectives recompute repeats -----------------------------------------------------

BASE = ["--model", "tiny", "--num-layers", "4", "--micro-batch-size", "1", "--global-batch-size", "8",
        "--train-iters", "5", "--lr", "3e-3", "--min-lr", "3e-4", "--lr-warmup-iters", "2", "--mock-data"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]
LAYOUTS = {
    "pp2-full-uniform-1": (2, ["--pipeline-model-parallel-size", "2", *_recompute("full", "uniform", 1)]),
    "pp2-full-block-1": (2, ["--pipeline-model-parallel-size", "2", *_recompute("full", "block", 1)]),
    "tp2-sp-full-uniform-2": (2, [*TP2_SP, *_recompute("full", "uniform", 2)]),
    "tp2-sp-selective": (2, [*TP2_SP, *_recompute("selective")]),
    # Interleaved chunks of one layer, each re-run in backward, where DDP's forward pre-hooks (the overlapped param
    # all-gather's waits) fire again and must find nothing left to wait for.
    "pp2-vpp2-dp2-distopt-overlap-full-uniform-1": (4, [
        "--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        *_recompute("full", "uniform", 1)]),
}


class TPCommCounter(NullProbeSet):
    """Counts the engine's TP collectives (the tp-comm ranges that carry bytes) per step: calls and bytes by op."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.per_step: dict[int, dict[str, list[int]]] = defaultdict(lambda: defaultdict(lambda: [0, 0]))

    def step_begin(self, iteration: int) -> None:
        self.step = iteration

    def range(self, name: str, category: str, **attrs):
        if category == "tp-comm" and attrs.get("bytes") is not None and self.step is not None:
            counted = self.per_step[self.step][normalize_op(name)]
            counted[0] += 1
            counted[1] += attrs["bytes"]
        return contextlib.nullcontext()


def train_counting_tp_comm(rank: int, world_size: int, argv: list[str]) -> dict:
    probes = TPCommCounter()
    result = train_and_collect(parse_args(argv, world_size=world_size), probes=probes)
    counted = {step: {op: tuple(c) for op, c in ops.items()} for step, ops in probes.per_step.items()}
    return result | {"tp_comm": counted}


def _ledger_layer_collectives(cfg: RunConfig, pp_rank: int) -> dict[str, tuple[int, int]]:
    """The ledger's per-step TP collectives of the layers, embedding and output layer, recompute's included, and the
    sequence-parallel norm grads' all-reduce (calls, bytes by op); the cross-entropy's all-reduces carry no byte count
    in the engine's ranges."""
    out: dict[str, tuple[int, int]] = {}
    for name, c in tp_collectives(cfg, pp_rank).items():
        if ".activations[" in name or ".recompute[" in name or ".norm_grads[" in name:
            calls, size = out.get(c.kind, (0, 0))
            out[c.kind] = (calls + c.calls, size + c.size_bytes)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_training_with_recompute_equals_training_without(layout):
    world, flags = LAYOUTS[layout]
    results = run_distributed(train_counting_tp_comm, world, BASE + flags)
    ref = reference(tuple(BASE), flag_value(flags, "--tensor-model-parallel-size"))  # no recompute, one process
    assert ref["losses"][-1] < ref["losses"][0], "the reference must actually train"
    cfg = parse_args(BASE + flags, world_size=world)
    for rank, res in enumerate(results):
        assert_close_rel(res["losses"], ref["losses"], f"rank {rank} loss")
        assert_close_rel(res["grad_norms"], ref["grad_norms"], f"rank {rank} grad norm")
        for name, value in res["params"].items():
            torch.testing.assert_close(value, ref["params"][name], rtol=1e-5, atol=1e-6,
                                       msg=lambda m, n=name: f"rank {rank} {n}: {m}")
        per_step = _ledger_layer_collectives(cfg, res["coordinates"]["pp"])  # none at TP 1
        assert res["tp_comm"] == {step: per_step for step in range(1, 6) if per_step}, f"rank {rank}"


# ---- plan and the reconciliation's peak row ------------------------------------------------------------------------

REFERENCE = ["--model", "llama3.2-1b", "--world-size", "8", "--tensor-model-parallel-size", "2",
        "--pipeline-model-parallel-size", "2", "--sequence-parallel", "--use-distributed-optimizer",
        "--seq-length", "8192", "--max-position-embeddings", "8192", "--global-batch-size", "16", "--bf16"]


@pytest.mark.parametrize("flags, modes", [
    (_recompute("full", "uniform", 2), ["full uniform 2", "none", "selective", "full uniform 1"]),
    (_recompute("selective"), ["selective", "none", "full uniform 1"]),
    ([], ["none", "selective", "full uniform 1"]),
])
def test_plan_shows_the_runs_mode_with_the_others_beside_it(flags, modes):
    cfg = parse_args(REFERENCE + flags)
    memory = build_plan(cfg)["memory"]
    assert memory["recompute"] == modes[0] and "logsumexp" in memory["recompute_convention"]
    by_mode, peaks = memory["activation_bytes_per_stage_by_recompute"], memory["peak_bytes_per_stage_by_recompute"]
    assert list(by_mode) == list(peaks) == modes
    assert memory["activation_bytes_per_stage"] == by_mode[modes[0]] == [peak_phase(cfg, i).total for i in (0, 1)]
    assert memory["peak_bytes_per_stage"] == peaks[modes[0]]
    # static memory does not depend on the mode: peak - activations is the same for all
    assert len({tuple(p - a for p, a in zip(peaks[m], by_mode[m])) for m in modes}) == 1
    text = render(build_plan(cfg))
    assert f"recompute {modes[0]}); in the peak: the loss's gradient (logits)" in text  # the last stage's
    assert all(f"{m}: activations" in text for m in modes[1:])


def test_peak_row_predicts_the_runs_recompute_mode():
    """A 1B-shaped run under full recompute: measured at the full-recompute prediction it is ok; measured at what
    no recompute would need (2 x 8 layers' whole saved sets instead of their inputs), off."""
    cfg = parse_args(["--model", "llama3.2-1b", "--world-size", "4", "--pipeline-model-parallel-size", "2",
                      "--seq-length", "8192", "--max-position-embeddings", "8192", "--global-batch-size", "8",
                      "--bf16", "--use-distributed-optimizer", *_recompute("full", "uniform", 1)])
    static = static_bytes(cfg, 0, 0, 0, "after_first_step").total
    full = static + activations.stage_activation_bytes(cfg, 0)
    none = static + activations.stage_activation_bytes(activations.with_recompute(cfg, RecomputeConfig()), 0)

    def peak_row(measured: int):
        evidence = RankEvidence(rank=0, coords={"tp": 0, "pp": 0, "dp": 0},
                                memory_steps=typed("memory", [{PEAK: measured, ALLOCATED: measured}]))
        (found,) = [r for r in rank_rows(cfg, evidence) if r.metric == "memory.peak_allocated"]
        return found

    assert peak_row(full).predicted == full and peak_row(full).verdict == "ok"
    assert "recompute full uniform 1" in peak_row(full).explanation
    assert peak_row(none).verdict == "off"
