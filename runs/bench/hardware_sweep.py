"""The compute sweep over a grid of model shapes, for a hardware file's efficiency curves (issue 18).

    python runs/bench/hardware_sweep.py --out OUT.json.gz [--quick]

A run's own `--compute-sweep` times its kernels at its own shapes only; `simulate` prices shapes no run of ours has
had (70B's h 8192, TP-local widths of TP 8, seq 2048 to 16384). This times the same kernels, through the same code
(probes.compute_sweep with the engine's own functions, engine/probe_adapters.py), at a grid of TP-local shapes of
public models: GEMMs from under a GFLOP to tens of TFLOP, flash attention from 1 to 64 local heads and seq 2048 to
16384, and the memory-bound kernels from a few MB to GBs. No training run is involved, so the hardware file fitted
from it (runs/bench/hardware_fit.py) never sees a step time it is later judged against.

--moe times an MoE layer's kernels beside its GEMMs instead (router top-k, moe.permute, moe.unpermute, through the
engine's router and dispatcher at EP 1, common/ops/moe.py) for Mixtral's layer (8 experts, top-2) and a fine-grained
one (64 experts of width 1408, top-6, hidden 2048) at 2,048 to 16,384 tokens, with and without the load-balancing
loss; only those kernels' records are kept (the experts' GEMMs and SwiGLU are the grid's kernels at other rows).
--experts keeps, of the same grid, the experts' GEMMs instead (linear_fc1 / linear_fc2 at the experts' row counts,
192 to 4,096: their wgrads reduce over so few rows, which no dense shape of the grid does).

--short-attention times, of the grid's models at every TP degree, seq 256, 512 and 1024 and micro-batches 1 to 8, the
flash attention alone (the hardware file's attention curves then reach the launch-bound shapes' sequences). Each
filtered grid times only the ops it keeps (kept_ops).

--megatron times Megatron-LM's unfused chains instead (--transformer-impl local without its fusions: the masked
softmax on [b, heads, s, s] in 16 bits and in fp32, K and V repeated, the unfused RoPE, SwiGLU and fp32 cross-entropy,
torch's foreach AdamW, each weight's 16-bit gradient added into main_grad; common/ops/megatron.py) at Llama and GPT-3
widths, seq 2048 to 8192, micro-batches 1 and 2;
only those chains' records are kept, so the other kernels' fits stay the grid's.

Output: {"device", "torch", "records": [compute records, each with its grid point's "shape" label], "not_measured"}.
"""
from __future__ import annotations

import argparse
import functools
import gzip
import json
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from common.arguments import parse_args  # noqa: E402
from common.config import RunConfig  # noqa: E402
from common.ops import Shapes  # noqa: E402
from common.ops.megatron import megatron_only  # noqa: E402
from common.ops.moe import is_routing_kernel  # noqa: E402
from common.ops.shapes import MegatronKernels  # noqa: E402
from common.ops.sizes import padded_vocab_size  # noqa: E402
from engine.probe_adapters import engine_kernels  # noqa: E402
from engine.tensor_parallel.mappings import TPGroup  # noqa: E402
from engine.transformer.moe.expert_parallel import EPGroup  # noqa: E402
from engine.transformer.moe.moe_layer import MoEContext, MoELayer  # noqa: E402
from probes import compute_sweep  # noqa: E402

# (label, hidden, ffn, heads, kv heads, vocab, tp): public shapes (Llama 3 1B / 8B / 70B, GPT-3 XL / 13B / 175B
# widths with a SwiGLU-sized ffn where Llama has one), each at the TP degrees a layout would use.
MODELS = (
    ("llama3.2-1b", 2048, 8192, 32, 8, 128256, (1, 2)),
    ("llama3.1-8b", 4096, 14336, 32, 8, 128256, (1, 2, 4, 8)),
    ("llama3.1-70b", 8192, 28672, 64, 8, 128256, (2, 4, 8)),
    ("gpt3-13b", 5120, 20480, 40, 40, 50304, (1, 2, 4, 8)),
    ("gpt3-175b", 12288, 49152, 96, 96, 50304, (4, 8)),
)
SEQS = (8192, 2048, 16384, 4096)
QUICK_SEQS = (4096,)


def _spec(h: int, f: int, heads: int, kv: int, vocab: int, tp: int, seq: int, mbs: int = 1,
          megatron: MegatronKernels | None = None) -> compute_sweep.SweepSpec:
    """A grid point's TP-local shapes (no SP, no CP: every op at seq x mbs tokens), as the catalogue's Shapes; a
    Megatron point without gradient-accumulation fusion (each weight's 16-bit gradient added into main_grad, as
    Megatron-LM's local runs here and a --no-gradient-accumulation-fusion run of the engine do)."""
    d, heads, kv = h // heads, heads // tp, max(1, kv // tp)
    shapes = Shapes(dtype="bf16", grad_dtype="fp32", seq=seq, micro_batch=mbs, hidden=h, tokens=seq * mbs,
                    norm_tokens=seq * mbs, heads=heads, kv_heads=kv, head_dim=d, qkv=(heads + 2 * kv) * d,
                    query=heads * d, ffn=f // tp, fc1=2 * (f // tp), swiglu=True, rope=True, norm="rms_norm",
                    vocab=padded_vocab_size(vocab, 128, tp) // tp, tp=tp, sequence_parallel=False,
                    megatron=megatron, unfused_wgrad=megatron is not None)
    return compute_sweep.SweepSpec(shapes, first_stage=True, last_stage=True, optimizer_numel=1 << 26,
                                   grad_buffer_numel=1 << 26)


def batch_specs(micro_batches: list[int]):
    """The attention-relevant grid again at larger micro-batches (what a run at mbs > 1 runs): every model at its
    first TP degree, seq 2048 / 4096 / 8192."""
    for mbs in micro_batches:
        for label, h, f, heads, kv, vocab, tps in MODELS:
            for seq in (2048, 4096, 8192):
                yield f"{label} tp{tps[0]} s{seq} mbs{mbs}", vocab, _spec(h, f, heads, kv, vocab, tps[0], seq, mbs)


SHORT_SEQS, SHORT_BATCHES = (256, 512, 1024), (1, 2, 4, 8)


def short_attention_specs():
    """Flash attention below the grid's shortest sequence (launch-bound shapes: seq 256-1024, where a kernel's fixed
    cost outweighs its FLOPs and the curves at seq 2048 price it several times too fast): every model at every TP
    degree (head dims 64 and 128, 4 to 96 local heads) at micro-batches 1 to 8."""
    for seq in SHORT_SEQS:
        for mbs in SHORT_BATCHES:
            for label, h, f, heads, kv, vocab, tps in MODELS:
                for tp in tps:
                    yield f"{label} tp{tp} s{seq} mbs{mbs}", vocab, _spec(h, f, heads, kv, vocab, tp, seq, mbs)


def megatron_specs():
    """Megatron-LM's local implementation with none of its fusions (main_grad.add too), softmax in 16 bits and in fp32
    by turns: the
    three smaller models at their first TP degree, seq 4096 first, then 2048 and 8192, each at micro-batches 1 and 2."""
    points = [(m, seq, mbs) for seq in (4096, 2048, 8192) for mbs in (1, 2) for m in MODELS[:2] + MODELS[3:4]]
    for i, ((label, h, f, heads, kv, vocab, tps), seq, mbs) in enumerate(points):
        kernels = MegatronKernels(unfused_attention=True, softmax_fp32=bool(i % 2), repeat_kv=heads > kv,
                                  unfused_rope=True, unfused_swiglu=True, foreach_optimizer=True)
        yield (f"{label} tp{tps[0]} s{seq} mbs{mbs} megatron{' fp32' if i % 2 else ''}", vocab,
               _spec(h, f, heads, kv, vocab, tps[0], seq, mbs, kernels))


# (label, flags): MoE layers whose router and dispatch kernels the --moe grid times, each at MOE_TOKENS (seq, mbs)
MOE_MODELS = (
    ("mixtral-8x7b", ["--model", "mixtral-8x7b"]),
    ("fine-grained 64x1408 top-6", ["--num-layers", "2", "--hidden-size", "2048", "--ffn-hidden-size", "1408",
                                    "--num-attention-heads", "16", "--vocab-size", "32000", "--num-experts", "64",
                                    "--moe-router-topk", "6"]),
)
MOE_TOKENS = ((4096, 1), (2048, 1), (8192, 1), (4096, 2), (16384, 1))
EXPERT_LINEARS = ("linear_fc1", "linear_fc2")  # at an MoE grid point, the experts' (every layer's MLP is experts)


def moe_specs(device: torch.device):
    """Each MoE layer at each (seq, micro-batch) of MOE_TOKENS, with the load-balancing loss (0.01) and without it,
    with the engine's kernels from one such layer, built when the point is measured (its router and dispatcher at
    EP 1)."""
    for (label, flags), (seq, mbs) in ((m, t) for t in MOE_TOKENS for m in MOE_MODELS):
        for aux in ("0.01", "0"):
            cfg = parse_args([*flags, "--seq-length", str(seq), "--micro-batch-size", str(mbs),
                              "--global-batch-size", str(mbs), "--bf16", "--moe-aux-loss-coeff", aux], world_size=1)
            spec = compute_sweep.SweepSpec(Shapes.of(cfg), first_stage=False, last_stage=False, optimizer_numel=1,
                                           grad_buffer_numel=1)
            yield f"{label} s{seq} mbs{mbs} aux {aux}", spec, functools.partial(_moe_kernels, cfg, device)


def _moe_kernels(cfg: RunConfig, device: torch.device) -> compute_sweep.EngineKernels:
    layer = MoELayer(cfg.model, 0, moe=MoEContext(ep=EPGroup(group=None, size=1, rank=0)),
                     tp=TPGroup(group=None, size=1, rank=0), params_dtype=torch.bfloat16, device=device, seed=1)
    return engine_kernels([layer], cfg.model.vocab_size, device)


def specs(quick: bool):
    """Every model once at its first TP degree and seq 4096 first (what --quick measures), then the rest of the grid:
    a run cut short by --budget-s still covers every model."""
    first = [(m, m[6][0], QUICK_SEQS[0]) for m in MODELS]
    rest = [(m, tp, seq) for seq in SEQS for m in MODELS for tp in m[6] if (m, tp, seq) not in first]
    for (label, h, f, heads, kv, vocab, _), tp, seq in first + ([] if quick else rest):
        yield f"{label} tp{tp} s{seq}", vocab, _spec(h, f, heads, kv, vocab, tp, seq)


def kept_ops(args: argparse.Namespace) -> Callable[[str], bool] | None:
    """The ops a filtered grid times (the rest of a grid point's kernels are the main grid's again), or None: all.
    A Megatron point keeps its unfused chains, an MoE point its routing kernels or its experts' GEMMs, a short
    attention point its flash attention."""
    if args.megatron:
        return megatron_only
    if args.moe:
        return is_routing_kernel
    if args.experts:
        return lambda op: op.rpartition(".")[0] in EXPERT_LINEARS
    if args.short_attention:
        return lambda op: op.startswith("core_attention.")
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--quick", action="store_true", help="one TP degree and one sequence length per model")
    which = ap.add_mutually_exclusive_group()  # one grid a sweep file
    which.add_argument("--micro-batches", type=int, nargs="+",
                       help="instead of the grid: every model's first TP degree at these micro-batch sizes")
    which.add_argument("--megatron", action="store_true", help="Megatron-LM's unfused chains instead of the grid")
    which.add_argument("--moe", action="store_true", help="an MoE layer's routing kernels instead of the grid")
    which.add_argument("--experts", action="store_true", help="the MoE grid's expert GEMMs instead of the grid")
    which.add_argument("--short-attention", action="store_true",
                       help="flash attention at seq 256-1024, micro-batches 1-8, instead of the grid")
    ap.add_argument("--budget-s", type=float, default=math.inf,
                    help="start no further shape after this many seconds (the file holds every shape finished)")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch._dynamo.config.recompile_limit = 1 << 10  # the engine's compiled functions meet a new shape per grid point
    records, start, skipped = [], time.perf_counter(), []
    grid = (moe_specs(device) if args.moe or args.experts else
            ((label, spec, functools.partial(engine_kernels, [], vocab, device)) for label, vocab, spec in
             (megatron_specs() if args.megatron else batch_specs(args.micro_batches) if args.micro_batches
              else short_attention_specs() if args.short_attention else specs(args.quick))))
    for label, spec, kernels in grid:
        if time.perf_counter() - start > args.budget_s:
            skipped.append(label)
            continue
        t0 = time.perf_counter()
        found = compute_sweep.run(spec, device, kernels(), use_cache=False, keep=kept_ops(args))
        records += [{**r, "shape": label} for r in found]
        write(args.out, device, records, skipped)  # after each shape: a run cut short keeps what it measured
        print(f"{label}: {len(found)} records in {time.perf_counter() - t0:.1f} s", flush=True)
    write(args.out, device, records, skipped)
    print(f"{len(records)} records in {time.perf_counter() - start:.0f} s -> {args.out}"
          + (f"; not measured (budget): {', '.join(skipped)}" if skipped else ""))
    print(f"command: python runs/bench/hardware_sweep.py --out {args.out}" + (" --quick" if args.quick else "")
          + (f" --micro-batches {' '.join(map(str, args.micro_batches))}" if args.micro_batches else "")
          + (" --megatron" if args.megatron else "") + (" --moe" if args.moe else "")
          + (" --experts" if args.experts else "") + (" --short-attention" if args.short_attention else "")
          + (f" --budget-s {args.budget_s:g}" if math.isfinite(args.budget_s) else ""))
    return 0


def write(path: str, device: torch.device, records: list[dict], skipped: list[str]) -> None:
    out = {"device": compute_sweep.device_name(device), "torch": torch.__version__, "records": records,
           "not_measured": skipped}
    with gzip.open(path + ".tmp", "wt") as f:
        json.dump(out, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    sys.exit(main())
