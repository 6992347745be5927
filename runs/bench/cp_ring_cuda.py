"""Context parallel's compute on one GPU (no second GPU was lent): the compute sweep of a CP rank's shapes on CUDA
(ring attention's causal diagonal block, its unmasked half block and the merge loops, as `--compute-sweep` times
them in a CP run), and the time model's ring attention of one layer composed from those records (C blocks and one
merge per pass; docs/formulas.md, Context parallel, "Time") against the engine's own ring_forward / ring_backward
timed whole on the same GPU on a ring with no process group (no exchange: what a rank computes, not what it waits).

    python runs/bench/cp_ring_cuda.py [--model llama3.2-1b] [--seq 16384] [--cp 2 4] [--json OUT]
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cli.calibrate import sweep_records  # noqa: E402
from common.arguments import parse_args  # noqa: E402
from engine.transformer.ring_attention import CPGroup, block_kernels, ring_backward, ring_forward  # noqa: E402


def cuda_median(fn, iters: int = 10, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def predicted_layer(records: list[dict], cp: int) -> dict[str, float]:
    """One layer's ring attention per pass from the sweep: the causal block, C - 1 half blocks, one merge."""
    def seconds(op: str, causal: int | None = None) -> float:
        (r,) = [r for r in records if r["op"] == op and (causal is None or r["dims"].get("causal") == causal)]
        return r["seconds"]
    return {p: seconds(f"core_attention.{p}", 1) + (cp - 1) * seconds(f"core_attention.{p}", 0)
            + seconds(f"ring_attention.merge.{p}") for p in ("fwd", "bwd")}


def measured_layer(cfg, cp: int, device) -> dict[str, float]:
    m, b = cfg.model, cfg.train.micro_batch_size
    local, d = m.seq_length // cp, m.head_dim
    q = torch.randn(b, m.num_attention_heads, local, d, device=device, dtype=torch.bfloat16)
    kv = torch.randn(2, b, m.num_query_groups, local, d, device=device, dtype=torch.bfloat16)
    ring = CPGroup(None, size=cp, rank=0, next_rank=None, prev_rank=None)
    scale, (attend, attend_backward) = 1 / math.sqrt(d), block_kernels(q)
    out, lse, last = ring_forward(q, kv, ring, scale, attend)
    out = out.to(q.dtype)
    dout = torch.randn_like(out)
    return {"fwd": cuda_median(lambda: ring_forward(q, kv, ring, scale, attend)),
            "bwd": cuda_median(lambda: ring_backward(dout, q, last, out, lse, ring, scale, attend_backward))}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama3.2-1b")
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--cp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    device = torch.device("cuda")
    out = {}
    for cp in a.cp:
        cfg = parse_args(["--model", a.model, "--bf16", "--context-parallel-size", str(cp), "--seq-length",
                          str(a.seq), "--max-position-embeddings", str(a.seq)], world_size=cp)
        records, _ = sweep_records(cfg, device, use_cache=False)
        pred, meas = predicted_layer(records, cp), measured_layer(cfg, cp, device)
        blocks = {f"{r['op']} causal={r['dims'].get('causal')}": r["seconds"] for r in records
                  if r["op"].startswith(("core_attention", "ring_attention"))}
        out[f"cp{cp}"] = {"predicted_s": pred, "measured_s": meas, "sweep_s": blocks}
        for phase in ("fwd", "bwd"):
            print(f"{a.model} seq {a.seq} CP{cp} ring attention {phase} per layer: predicted {pred[phase] * 1e3:.3f}"
                  f" ms, measured {meas[phase] * 1e3:.3f} ms ({pred[phase] / meas[phase] - 1:+.1%})")
        for name, seconds in blocks.items():
            print(f"    sweep {name}: {seconds * 1e3:.3f} ms")
    print("command: python " + " ".join(sys.argv))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
