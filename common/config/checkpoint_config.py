"""Megatron's checkpoint flags, and their checks (the checkpoint directory's own layout: checkpoint_layout)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from common.errors import ConfigError


@dataclass
class CheckpointConfig:
    """Megatron's checkpoint flags (engine/checkpointing.py; docs/engine.md, "Checkpoints"): where to save and how
    often, where to resume from and what to take from it, and when to stop early (as a preempted job does)."""
    save: str | None = None
    save_interval: int | None = None
    load: str | None = None
    exit_interval: int | None = None
    exit_duration_in_mins: float | None = None  # stop (saving first) once training has run this long
    async_save: bool = False  # write in a background thread after a blocking copy to host memory
    no_load_optim: bool = False
    no_load_rng: bool = False
    finetune: bool = False


def check_checkpoint_flags(c: CheckpointConfig, train_iters: int) -> None:
    """Counts >= 1, a duration a finite number of minutes > 0; a flag that could have no effect is an error rather
    than ignored (an --async-save without --save, an exit after the last iteration, a load option without --load),
    except --save-interval without --save, which Megatron accepts and saves nothing with (a script may pass a
    --save-interval longer than the run and no --save)."""
    for flag, value in (("--save-interval", c.save_interval), ("--exit-interval", c.exit_interval)):
        if value is not None and value < 1:
            raise ConfigError(f"{flag} must be >= 1, got {value}")
    if c.exit_duration_in_mins is not None and not (math.isfinite(c.exit_duration_in_mins)
                                                    and c.exit_duration_in_mins > 0):
        raise ConfigError(f"--exit-duration-in-mins must be a number of minutes > 0, got {c.exit_duration_in_mins}")
    if c.exit_interval is not None and c.exit_interval > train_iters:
        raise ConfigError(f"--exit-interval {c.exit_interval} is beyond --train-iters {train_iters}: it would never "
                          "stop the run")
    for flag, value in (("--no-load-optim", c.no_load_optim), ("--no-load-rng", c.no_load_rng),
                        ("--finetune", c.finetune)):
        if value and c.load is None:
            raise ConfigError(f"{flag} needs --load DIR")
    if c.async_save and c.save is None:
        raise ConfigError("--async-save needs --save DIR")
