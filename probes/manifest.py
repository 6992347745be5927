"""The run manifest: who ran what, where, with which versions, and whether it finished.

Building it is collective (every rank contributes its host, device, coordinates and probe notes through
all_gather_object on the world group); rank 0 writes it. The status starts "running" and is only ever moved to
"complete" by rank 0's clean close, or to "failed" by any rank's failing close (a failure is never overwritten by
a later "complete"). A run killed outright keeps "running" and no `ended`: that is how a reader knows it is
incomplete.
"""
from __future__ import annotations

import datetime as _dt
import os
import platform
import socket
import subprocess
import uuid
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from common.rank_info import DeviceInfo, RankInfo
from common.run_dir import now_iso, read_manifest, update_manifest

REPO_ROOT = Path(__file__).resolve().parent.parent


def git_sha() -> str | None:
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                             timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def versions() -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    nccl = None
    if cuda and hasattr(torch.cuda, "nccl"):
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version())
    return {"torch": torch.__version__, "cuda": torch.version.cuda, "nccl": nccl, "driver": _driver_version(),
            "python": platform.python_version()}


def _driver_version() -> str | None:
    if not torch.cuda.is_available():
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            version = pynvml.nvmlSystemGetDriverVersion()
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - ImportError or pynvml's NVMLError tree: the driver version is optional
        return None
    return version.decode() if isinstance(version, bytes) else version


def rank_info(parallel_state: Any, notes: dict[str, str]) -> dict[str, Any]:
    """This rank's entry in the manifest's `ranks` list. The backend tells the ledger which trace figures are
    measurements (gloo's profiler annotations are not, for some collectives); a CPU's core count tells it how many
    ranks compete for each core; `groups` are the process groups this rank actually joined (kind -> global ranks),
    which the ledger checks against its own derivation of Megatron's rule."""
    if torch.cuda.is_available():
        index = torch.cuda.current_device()
        device = DeviceInfo(type="cuda", index=index, name=torch.cuda.get_device_name(index),
                            total_bytes=torch.cuda.get_device_properties(index).total_memory)
    else:
        device = DeviceInfo(type="cpu", name=platform.processor() or platform.machine(), cores=usable_cores())
    backend = dist.get_backend() if dist.is_initialized() else None
    return RankInfo(rank=parallel_state.rank, host=socket.gethostname(), pid=os.getpid(), device=device,
                    backend=backend, coords=dict(parallel_state.coordinates),
                    groups={kind: list(ranks) for kind, ranks in parallel_state.ranks.items()},
                    probes=notes).to_json()


def usable_cores() -> int | None:
    """Cores this process may run on (its affinity mask, what a container or taskset grants), not the host's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()


def gather_rank_infos(info: dict[str, Any]) -> list[dict[str, Any]]:
    """Collective over the world: every rank's info, indexed by rank."""
    if not dist.is_initialized():
        return [info]
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, info, group=dist.group.WORLD)
    return gathered


def build_manifest(run_config: Any, argv: list[str], ranks: list[dict[str, Any]], run_id: str) -> dict[str, Any]:
    return {"run_id": run_id, "framework": "train-ledger", "argv": list(argv), "config": run_config.to_dict(),
            "world_size": len(ranks), "ranks": ranks, "versions": versions(), "git_sha": git_sha(),
            "started": now_iso(), "ended": None, "status": "running", "error": None}


def new_run_id() -> str:
    return _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + uuid.uuid4().hex[:8]


def shared_run_id() -> str:
    """Collective over the world: rank 0's new id on every rank. The manifest and every rank's traces carry it, so
    the ledger can tell a trace copied in from another run."""
    run_id = [new_run_id()]
    if dist.is_initialized():
        dist.broadcast_object_list(run_id, src=0, group=dist.group.WORLD)
    return run_id[0]


def finish(run_dir: Path, rank: int, status: str, error: str | None) -> None:
    """Record the end: rank 0 on success, any rank on failure. A recorded failure is never turned into success, nor
    its error replaced: the first rank to fail recorded the cause; the others fail of it after (a peer's closed
    connection, the SIGTERM torchrun sends them), and the run must say what stopped it, not what stopped them."""
    if status == "complete" and rank != 0:
        return
    current = read_manifest(run_dir)
    if current["status"] == "failed":
        update_manifest(run_dir, ended=now_iso())
        return
    fields: dict[str, Any] = {"status": status, "ended": now_iso()}
    if status == "failed":
        fields.update(error=error, failed_rank=rank)
    update_manifest(run_dir, **fields)
