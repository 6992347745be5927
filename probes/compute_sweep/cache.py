"""The sweep's disk cache under $XDG_CACHE_HOME/train-ledger/compute (default ~/.cache), keyed by device name, torch
version, the planned ops with their dims and dtypes, the engine's kernel variant, whether its weight-gradient GEMMs
accumulate into main_grad themselves (the fusion; off, each wgrad is timed with its add) and (CPU) the thread count,
so that
a later run on the same machine and shapes skips the measurement. Best effort: an entry that cannot be written (a
read-only home) costs a later run a measurement, never this run."""
from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

from common.errors import InputError
from common.run_dir import atomic_write_text
from probes.compute_sweep.handles import EngineKernels
from probes.compute_sweep.planned import Planned

# bump when what a record measures changes: older cache entries are then not read (4: optimizer.step's clip in the
# fused update)
SWEEP_VERSION = 4


def cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "train-ledger" / "compute"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu {platform.processor() or platform.machine()}"


def cache_key(planned: list[Planned], device: torch.device, kernels: EngineKernels) -> dict[str, Any]:
    return {"version": SWEEP_VERSION, "device": device_name(device), "torch": torch.__version__,
            "variant": kernels.variant, "wgrad_fusion": kernels.wgrad_fusion,
            "threads": torch.get_num_threads() if device.type == "cpu" else None,
            "ops": [[p.op, p.dims, p.dtype] for p in planned]}


def _cache_file(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir() / f"{digest}.json"


def cached(key: dict[str, Any]) -> list[dict[str, Any]] | None:
    try:
        entry = json.loads(_cache_file(key).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return entry["records"] if isinstance(entry, dict) and entry.get("key") == key else None


def store(key: dict[str, Any], records: list[dict[str, Any]]) -> None:
    try:
        atomic_write_text(_cache_file(key), json.dumps({"key": key, "records": records}, sort_keys=True) + "\n")
    except (InputError, OSError):
        pass
