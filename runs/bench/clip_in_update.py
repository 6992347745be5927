"""The optimizer step's clip: a pass over the fp32 grads, or inside fused AdamW's update (its grad_scale).

    python runs/bench/clip_in_update.py [--params 1.24e9 3.2e9] [--repeats 5]

For each parameter count (llama3.2-1b's 1.24 B, mixtral-8x7b-2l's 3.2 B): fp32 main params and grads, fused AdamW, the
grad norm, then either the engine's former clip (`_foreach_mul_` over the grads) or the clip in the update
(engine/optimizer/clip_grads.py with the optimizer), then the step; CUDA events, the median of --repeats after one
warm-up, and the largest difference between the two runs' parameters after the same three steps. Needs CUDA.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from engine.optimizer.clip_grads import clip_grad_by_total_norm_fp32  # noqa: E402

CHUNK = 1 << 27  # elements a parameter tensor, so the foreach kernels see many tensors, as a model's


def update(numel: int, in_update: bool, steps: int, seed: int = 0) -> tuple[list[float], torch.Tensor]:
    """Seconds of each step after the first, and the parameters after them."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    sizes = [min(CHUNK, numel - i) for i in range(0, numel, CHUNK)]
    params = [torch.nn.Parameter(torch.randn(n, device="cuda", generator=gen)) for n in sizes]
    grads = [torch.randn(n, device="cuda", generator=gen) * 10 for n in sizes]
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.01, fused=True)
    times = []
    for step in range(steps):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        norm = torch.stack(torch._foreach_norm([p.grad for p in params])).square().sum().sqrt()
        clip_grad_by_total_norm_fp32([p.grad for p in params], 1.0, norm, optimizer if in_update else None)
        optimizer.step()
        end.record()
        end.synchronize()
        if step:
            times.append(start.elapsed_time(end) / 1e3)
    return times, torch.cat([p.detach().flatten()[:1 << 20] for p in params])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=float, nargs="+", default=[1.24e9, 3.2e9])
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("clip_in_update.py: needs CUDA", file=sys.stderr)
        return 2
    print("| params | clip then update ms | clip in the update ms | saved ms | max param difference |")
    print("|---|---|---|---|---|")
    for n in (int(x) for x in a.params):
        before, p_before = update(n, False, a.repeats + 1)
        after, p_after = update(n, True, a.repeats + 1)
        b, f = statistics.median(before), statistics.median(after)
        diff = (p_before - p_after).abs().max().item()
        print(f"| {n / 1e9:.2f} B | {b * 1e3:.2f} | {f * 1e3:.2f} | {(b - f) * 1e3:.2f} | {diff:.2e} |")
        torch.cuda.empty_cache()
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("command: python3 runs/bench/clip_in_update.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
