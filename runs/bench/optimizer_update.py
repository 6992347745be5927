"""The optimizer's update as the engine runs it: torch's fused AdamW over the pieces then the copy into the 16-bit
params, against one Triton kernel a buffer doing both (below: a negative result, BENCHMARKS.md 2026-12-04 eighth
entry, so the kernel lives here and not in the engine).

The kernel: each program takes one block of at most BLOCK elements of one piece, at its offset in the compact fp32
storages (main params, exp_avg, exp_avg_sq) and in the DDP buffers (grads, 16-bit params), and does torch's fused
AdamW arithmetic (aten's fused_adam_utils.cuh, ADAMW mode) in registers, writing the 16-bit param in the same pass.

    python runs/bench/optimizer_update.py [--shapes llama3.2-1b mixtral-8x7b-2l] [--repeats 7]

For each shape: its parameters' sizes as pieces of one bf16 param buffer and one fp32 grad buffer (starts aligned to
64 elements, as DDP's layout), fp32 main params in one compact storage; the clip's grad_scale set as the engine sets
it. CUDA events around the update alone (the grad norm is the same in both), the median of --repeats after two
warm-ups, TB/s from the bytes each must move (torch: 32 B an element for Adam, which writes the divided gradient
back, and 6 B for the copy; Triton: 30 B), for each of the kernel's --configs, and the largest difference between
the two paths' bf16 params and fp32 main params after the same steps on the same gradients. Needs CUDA.
"""
from __future__ import annotations

import argparse
import functools
import math
import statistics
import sys
from dataclasses import dataclass
from typing import Any, Sequence

import torch

DDP_ALIGN = 64  # DDP's layout starts every parameter at a multiple of 64 elements
BLOCK = 4096  # elements a program updates: 16 KiB of each fp32 stream


@dataclass(frozen=True)
class Piece:
    """One parameter piece: `numel` elements at `compact` in the fp32 storages and at `buffer` in the DDP buffers;
    `decays`: weight decay applies to it."""
    compact: int
    buffer: int
    numel: int
    decays: bool


ALIGN = 16  # elements: blocks whose two offsets are multiples of it load and store 64-byte vectors


@dataclass(frozen=True)
class PieceTable:
    """Blocks of at most `block` elements of the pieces whose two offsets are both multiples of ALIGN (`aligned`)
    or not: offsets [blocks, 2] int64 (compact, buffer), counts [blocks] int32, decay [blocks] fp32 (1 where weight
    decay applies), on the update's device."""
    offsets: torch.Tensor
    counts: torch.Tensor
    decay: torch.Tensor
    block: int
    aligned: bool

    @classmethod
    def of(cls, pieces: Sequence[Piece], device: torch.device | str, block: int = BLOCK) -> list["PieceTable"]:
        rows: dict[bool, list[tuple[int, int, int, float]]] = {True: [], False: []}
        for piece in pieces:
            for start in range(0, piece.numel, block):
                compact, buffer = piece.compact + start, piece.buffer + start
                rows[compact % ALIGN == 0 and buffer % ALIGN == 0].append(
                    (compact, buffer, min(block, piece.numel - start), 1.0 if piece.decays else 0.0))
        return [cls(offsets=torch.tensor([r[:2] for r in blocks], dtype=torch.int64, device=device).reshape(-1, 2),
                    counts=torch.tensor([r[2] for r in blocks], dtype=torch.int32, device=device),
                    decay=torch.tensor([r[3] for r in blocks], dtype=torch.float32, device=device),
                    block=block, aligned=aligned)
                for aligned, blocks in rows.items() if blocks]

    @property
    def blocks(self) -> int:
        return self.counts.numel()


@dataclass(frozen=True)
class AdamWStep:
    """One step's scalars: lr and weight_decay (the group's), betas, eps and the step number t (from 1)."""
    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    step: int

    @property
    def step_size(self) -> float:
        return self.lr / (1.0 - self.beta1 ** self.step)

    @property
    def bias_correction2_sqrt(self) -> float:
        return math.sqrt(1.0 - self.beta2 ** self.step)


@functools.cache
def _kernel() -> Any:
    import triton
    import triton.language as tl

    @triton.jit
    def adamw_pieces(offsets_ptr, counts_ptr, decay_ptr, main_ptr, exp_avg_ptr, exp_avg_sq_ptr, grad_ptr,
                     model_ptr, grad_scale_ptr, lr, weight_decay, beta1, beta2, eps, step_size,
                     bias_correction2_sqrt, BLOCK: tl.constexpr, ALIGNED: tl.constexpr, WRITE_MODEL: tl.constexpr,
                     HAS_SCALE: tl.constexpr):
        block = tl.program_id(0)
        compact = tl.load(offsets_ptr + 2 * block)
        buffer = tl.load(offsets_ptr + 2 * block + 1)
        if ALIGNED:
            compact = tl.multiple_of(compact, 16)
            buffer = tl.multiple_of(buffer, 16)
        n = tl.load(counts_ptr + block)
        decay = tl.load(decay_ptr + block)
        idx = tl.arange(0, BLOCK)
        mask = idx < n
        grad = tl.load(grad_ptr + buffer + idx, mask=mask).to(tl.float32)
        if HAS_SCALE:
            grad = grad / tl.load(grad_scale_ptr)
        param = tl.load(main_ptr + compact + idx, mask=mask)
        exp_avg = tl.load(exp_avg_ptr + compact + idx, mask=mask)
        exp_avg_sq = tl.load(exp_avg_sq_ptr + compact + idx, mask=mask)
        param = param - lr * weight_decay * decay * param
        exp_avg = beta1 * exp_avg + (1.0 - beta1) * grad
        exp_avg_sq = beta2 * exp_avg_sq + (1.0 - beta2) * grad * grad
        denom = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
        param = param - step_size * exp_avg / denom
        tl.store(main_ptr + compact + idx, param, mask=mask)
        tl.store(exp_avg_ptr + compact + idx, exp_avg, mask=mask)
        tl.store(exp_avg_sq_ptr + compact + idx, exp_avg_sq, mask=mask)
        if WRITE_MODEL:
            tl.store(model_ptr + buffer + idx, param.to(model_ptr.dtype.element_ty), mask=mask)

    return adamw_pieces


def adamw_pieces(tables: Sequence[PieceTable], main: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                 grad: torch.Tensor, model: torch.Tensor | None, grad_scale: torch.Tensor | None,
                 step: AdamWStep, num_warps: int = 4) -> None:
    """The update of every piece in `tables`: main, exp_avg, exp_avg_sq the compact fp32 storages (main may be the
    fp32 param buffer itself, model then None), grad and model the DDP buffers; grad_scale a 0-d fp32 device tensor
    each gradient is divided by, or None."""
    for table in tables:
        _kernel()[(table.blocks,)](
            table.offsets, table.counts, table.decay, main, exp_avg, exp_avg_sq, grad,
            main if model is None else model, main if grad_scale is None else grad_scale,
            step.lr, step.weight_decay, step.beta1, step.beta2, step.eps, step.step_size, step.bias_correction2_sqrt,
            BLOCK=table.block, ALIGNED=table.aligned, WRITE_MODEL=model is not None,
            HAS_SCALE=grad_scale is not None, num_warps=num_warps)


def shape_sizes(name: str) -> list[int]:
    """Parameter numels (with the 1-D norms), in buffer order, of the two Engine VII shapes."""
    if name == "llama3.2-1b":
        h, f, kv, v, layers = 2048, 8192, 512, 128256, 16
        layer = [h, h * (h + 2 * kv), h * h, h, 2 * f * h, f * h]
        return [v * h, *layer * layers, h, v * h]
    if name == "mixtral-8x7b-2l":
        h, f, kv, v, layers, experts = 4096, 14336, 1024, 32000, 2, 8
        layer = [h, h * (h + 2 * kv), h * h, h, experts * h, *[2 * f * h, f * h] * experts]
        return [v * h, *layer * layers, h, v * h]
    raise SystemExit(f"optimizer_update.py: unknown shape {name!r}")


def pieces_of(sizes: list[int]) -> tuple[list[Piece], int]:
    pieces, compact, buffer = [], 0, 0
    for n in sizes:
        pieces.append(Piece(compact=compact, buffer=buffer, numel=n, decays=True))
        compact += n
        buffer += -(-n // DDP_ALIGN) * DDP_ALIGN
    return pieces, buffer


class State:
    """A shape's buffers and storages, from one seed."""

    def __init__(self, sizes: list[int], seed: int):
        self.pieces, buffer_numel = pieces_of(sizes)
        numel = sum(sizes)
        gen = torch.Generator(device="cuda").manual_seed(seed)
        self.main = torch.randn(numel, device="cuda", generator=gen)
        self.fresh_grad = torch.randn(buffer_numel, device="cuda", generator=gen)
        self.grad = self.fresh_grad.clone()
        self.model = torch.zeros(buffer_numel, device="cuda", dtype=torch.bfloat16)
        self.grad_scale = torch.tensor(1.25, device="cuda")

    def views(self, storage: torch.Tensor, at: str) -> list[torch.Tensor]:
        return [storage[getattr(p, at):getattr(p, at) + p.numel] for p in self.pieces]


def torch_path(state: State):
    mains = state.views(state.main, "compact")
    for m, g in zip(mains, state.views(state.grad, "buffer")):
        m.grad = g
    optimizer = torch.optim.AdamW(mains, lr=1e-4, weight_decay=0.01, fused=True)
    models = state.views(state.model, "buffer")

    def update() -> None:
        optimizer.grad_scale = state.grad_scale
        optimizer.step()
        torch._foreach_copy_(models, mains)
    return update


def triton_path(state: State, block: int, num_warps: int):
    tables = PieceTable.of(state.pieces, "cuda", block)
    exp_avg, exp_avg_sq = torch.zeros_like(state.main), torch.zeros_like(state.main)
    steps = [0]

    def update() -> None:
        steps[0] += 1
        adamw_pieces(tables, state.main, exp_avg, exp_avg_sq, state.grad, state.model, state.grad_scale,
                     AdamWStep(lr=1e-4, weight_decay=0.01, beta1=0.9, beta2=0.999, eps=1e-8, step=steps[0]),
                     num_warps)
    return update


def timed(update, state: State, repeats: int) -> list[float]:
    """Each step on fresh gradients (torch's fused AdamW writes the divided ones back), copied outside the timing."""
    times = []
    for i in range(repeats + 2):
        state.grad.copy_(state.fresh_grad)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        update()
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) / 1e3)
    return times


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", default=["llama3.2-1b", "mixtral-8x7b-2l"])
    ap.add_argument("--configs", nargs="+", default=["4096:4", "1024:4", "2048:8", "4096:8", "8192:16"],
                    help="the Triton kernel's BLOCK:num_warps, each timed")
    ap.add_argument("--repeats", type=int, default=7)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("optimizer_update.py: needs CUDA", file=sys.stderr)
        return 2
    print("| shape | params | path | ms | TB/s (bytes moved) | torch / this | max diff bf16 params | "
          "max diff main params |")
    print("|---|---|---|---|---|---|---|---|")
    for shape in a.shapes:
        sizes = shape_sizes(shape)
        numel = sum(sizes)
        reference = State(sizes, seed=0)
        torch_s = statistics.median(timed(torch_path(reference), reference, a.repeats))
        # torch: Adam reads p, g, m, v and writes p, m, v and the divided g (32 B), then the copy (6 B)
        print(f"| {shape} | {numel / 1e9:.3f} B | torch fused AdamW + copy | {torch_s * 1e3:.2f} | "
              f"{numel * 38 / torch_s / 1e12:.2f} | 1 | — | — |", flush=True)
        for config in a.configs:
            block, warps = (int(x) for x in config.split(":"))
            state = State(sizes, seed=0)
            t = statistics.median(timed(triton_path(state, block, warps), state, a.repeats))
            print(f"| {shape} | {numel / 1e9:.3f} B | Triton {block}:{warps} | {t * 1e3:.2f} | "
                  f"{numel * 30 / t / 1e12:.2f} | {torch_s / t:.3f}x | "
                  f"{(reference.model.float() - state.model.float()).abs().max().item():.3g} | "
                  f"{(reference.main - state.main).abs().max().item():.3g} |", flush=True)
            del state
            torch.cuda.empty_cache()
        del reference
        torch.cuda.empty_cache()
    print("command: python3 runs/bench/optimizer_update.py " + " ".join(sys.argv[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
