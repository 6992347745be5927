"""Device memory outside PyTorch's caching allocator, per rank: what NVML counts as used beyond `reserved`.

    outside = driver reserve + CUDA context + NCCL communicators + library modules
    NCCL    = first communicator (the default group, created at init_process_group with a device id: eager)
              + one per process group of more than one rank the rank belongs to (engine.parallel_state creates no
                torch.distributed group of one rank; eager initialisation builds a communicator at creation). A run
                whose manifest predates that (ParallelConfig.communicators_for_groups_of_one) held one per group
                kind, groups of one included.

The terms are constants of a device kind, driver and library stack, measured once by runs/bench/outside_pytorch.py
(a separate program, never the run being judged) and stored in ledger/models/calibration/<device>.json with their
provenance; the count of communicators comes from the ledger's own rank groups (ledger/evidence/layout.py). On one H200
each further communicator costs 389 MiB and the first 650 MiB; cuBLAS / cuBLASLt and the flash-attention kernels
add 84 MiB of loaded modules; the driver keeps 615 MiB that NVML reports as used (NVML total - CUDA total).
Not modelled: buffers a communicator of several ranks allocates per peer and channel (measured only for groups of
one), NCCL_BUFFSIZE and other environment overrides, other processes on the device.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from common.config import RunConfig
from ledger.evidence.layout import (
    Layout,
    expert_group_lists,
    expert_layout,
    rank_groups_of,
)

CALIBRATION_DIR = Path(__file__).resolve().parent.parent / "calibration"


@dataclass(frozen=True)
class DeviceOverheads:
    device: str
    driver_reserved: int
    cuda_context: int
    nccl_first_communicator: int
    nccl_communicator: int
    library_modules: int
    provenance: str
    allocator_workspaces: int = 0  # inside PyTorch: cuBLAS / cuBLASLt workspaces (peak_memory.persistent_bytes)

    @classmethod
    def known(cls, device_name: str) -> "DeviceOverheads | None":
        """The calibration of `device_name` (as torch names it, e.g. "NVIDIA H200"), or None when none is stored."""
        path = CALIBRATION_DIR / (device_name.lower().replace(" ", "_").replace("-", "_") + ".json")
        if not path.is_file():
            return None
        d = json.loads(path.read_text())
        return cls(device=d["device"], driver_reserved=d["driver_reserved"], cuda_context=d["cuda_context"],
                   nccl_first_communicator=d["nccl_first_communicator"], nccl_communicator=d["nccl_communicator"],
                   library_modules=d["library_modules"], provenance=d["measured"],
                   allocator_workspaces=d.get("allocator_workspaces", 0))


@dataclass(frozen=True)
class OutsidePyTorch:
    terms: dict[str, int]  # name -> bytes, in the order they are created

    @property
    def total(self) -> int:
        return sum(self.terms.values())


def communicators(cfg: RunConfig, rank: int) -> int:
    """NCCL communicators a rank of this layout holds: the default group's and one per group of more than one rank
    it belongs to (module docstring), among the dense kinds and, for an MoE model, the kinds of Megatron's expert
    grid (which the engine builds for MoE models only)."""
    p = cfg.parallel
    layout = Layout.of(p.world_size, tp=p.tensor_model_parallel_size, pp=p.pipeline_model_parallel_size,
                       cp=p.context_parallel_size, order=p.order)
    groups = list(rank_groups_of(layout, rank).values())
    if cfg.model.is_moe:
        expert = expert_group_lists(expert_layout(p.world_size, tp=p.tensor_model_parallel_size,
                                                  pp=p.pipeline_model_parallel_size, ep=p.expert_model_parallel_size,
                                                  order=p.order))
        groups += [group for lists in expert.values() for group in lists if rank in group]
    smallest = 1 if p.communicators_for_groups_of_one else 2
    return 1 + sum(1 for group in groups if len(group) >= smallest)


def outside_pytorch(cfg: RunConfig, rank: int, device: DeviceOverheads) -> OutsidePyTorch:
    groups = communicators(cfg, rank) - 1
    return OutsidePyTorch(terms={
        "driver reserve": device.driver_reserved,
        "CUDA context": device.cuda_context,
        "NCCL default communicator": device.nccl_first_communicator,
        f"NCCL communicators of {groups} groups": groups * device.nccl_communicator,
        "cuBLAS / attention modules": device.library_modules,
    })
