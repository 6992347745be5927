"""The probes' flags (what the run directory records; probes.probe_set), and their checks."""
from __future__ import annotations

from dataclasses import dataclass, field

from common.errors import ConfigError


@dataclass
class ProbeConfig:
    run_dir: str | None = None
    tensorboard_dir: str | None = None
    log_memory_to_tensorboard: bool = False
    use_pytorch_profiler: bool = False
    profile_step_start: int = 10
    profile_step_end: int = 12
    profile_ranks: list[int] = field(default_factory=lambda: [0])
    nsys_profile: bool = False
    record_memory_history: bool = False
    nvml_interval: float = 0.0
    nvtx: bool = False
    timers: bool = False
    bandwidth_sweep: bool = False
    compute_sweep: bool = False
    compute_sweep_cache: bool = True  # reuse this machine's cached sweep of the same shapes
    host_sweep: bool = False


def check_probes(pr: ProbeConfig, world_size: int) -> None:
    """The profiler's window runs forward, on ranks of the world."""
    if pr.profile_step_end < pr.profile_step_start:
        raise ConfigError(f"--profile-step-end {pr.profile_step_end} is before --profile-step-start "
                          f"{pr.profile_step_start}")
    bad_ranks = [r for r in pr.profile_ranks if not 0 <= r < world_size]
    if bad_ranks:
        raise ConfigError(f"--profile-ranks {bad_ranks[0]} is outside the world of {world_size} ranks")
