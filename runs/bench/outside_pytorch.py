"""Where a GPU's memory outside PyTorch's caching allocator goes: NVML's device-wide used bytes and the process's
own (per-process NVML accounting) after each thing a training rank sets up, beside the allocator's reserved bytes.

    python runs/bench/outside_pytorch.py [--json OUT]

Steps, in a training rank's order: torch imported (no CUDA yet) -> CUDA context -> NCCL process group of one rank ->
its first collective (the communicator) -> the engine's process groups (engine.parallel_state: none of one rank has a
communicator) and a collective on each communicator -> four more groups of one rank -> a bf16 GEMM (cuBLAS / cuBLASLt
handles) -> SDPA flash attention forward and backward -> a compiled pointwise kernel (Triton) -> a fused AdamW step.
Each line: device used, this process's used, allocator reserved, and outside = process used - reserved, with the
step's increment.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist


def nvml_figures(handle, pynvml) -> tuple[int, int | None]:
    used = pynvml.nvmlDeviceGetMemoryInfo(handle).used
    mine = None
    for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
        if proc.pid == os.getpid():
            mine = proc.usedGpuMemory
    return used, mine


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", help="write the points here too")
    args = ap.parse_args()
    import pynvml

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(0)
    points = []

    def point(name: str) -> None:
        if torch.cuda.is_initialized():
            torch.cuda.synchronize()
        used, mine = nvml_figures(handle, pynvml)
        reserved = torch.cuda.memory_reserved() if torch.cuda.is_initialized() else 0
        points.append({"point": name, "device_used": used, "process_used": mine, "reserved": reserved,
                       "outside": (mine if mine is not None else used) - reserved})
        prev = points[-2]["outside"] if len(points) > 1 else points[-1]["outside"]
        print(f"{name:28s} device {used / 2**20:10.1f} MiB  process {(mine or 0) / 2**20:10.1f} MiB  reserved "
              f"{reserved / 2**20:10.1f} MiB  outside {points[-1]['outside'] / 2**20:10.1f} MiB "
              f"(+{(points[-1]['outside'] - prev) / 2**20:.1f})", flush=True)

    point("torch imported")
    torch.cuda.set_device(0)
    torch.empty(1, device="cuda")
    point("cuda context")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29513")
    dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", 0))
    point("nccl process group")
    x = torch.ones(1024, device="cuda")
    dist.all_reduce(x)
    point("first all_reduce")
    from engine.parallel_state import LayoutGroup, ParallelState

    state = ParallelState.initialize(1, 1, 1)
    communicators = [g for g in state.groups.values() if not isinstance(g, LayoutGroup)]
    point(f"engine's {len(state.groups)} groups, {len(communicators)} with a communicator")
    for group in communicators:
        dist.all_reduce(x, group=group)
    point("a collective on each communicator")
    extra = [dist.new_group([0]) for _ in range(4)]
    for group in extra:
        dist.all_reduce(x, group=group)
    point("4 more groups, used")
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    point("bf16 GEMM")
    q = torch.randn(1, 32, 4096, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    out = torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    out.sum().backward()
    point("SDPA fwd+bwd")
    f = torch.compile(lambda t: torch.nn.functional.silu(t) * t)
    f(a).sum().item()
    point("compiled pointwise")
    w = torch.nn.Parameter(torch.randn(4096, 4096, device="cuda"))
    w.grad = torch.randn_like(w)
    opt = torch.optim.AdamW([w], fused=True)
    opt.step()
    point("fused AdamW step")
    dist.destroy_process_group()
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                       "driver": pynvml.nvmlSystemGetDriverVersion(), "points": points}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
