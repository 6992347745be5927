"""TensorBoard scalars under Megatron's key names, so a Megatron user's dashboards read our runs unchanged.

Like Megatron's training_log(), only the last rank writes (it holds the loss under pipeline parallelism), and the
mem-* keys are written only with --log-memory-to-tensorboard. "throughput" is Megatron's TFLOP/s per GPU; it is
written only when the engine passes it (step_end(throughput=...)), never guessed from tokens/s.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

# step_end figure -> Megatron's TensorBoard key
STEP_KEYS = {
    "loss": "lm loss",
    "lr": "learning-rate",
    "grad_norm": "grad-norm",
    "step_time_s": "iteration-time",
    "throughput": "throughput",
}
# memory_stats key -> Megatron's TensorBoard key
MEMORY_KEYS = {
    "reserved_bytes.all.current": "mem-reserved-bytes",
    "allocated_bytes.all.current": "mem-allocated-bytes",
    "allocated_bytes.all.peak": "mem-max-allocated-bytes",
}


class TensorBoardLog:
    def __init__(self, logdir: Path, log_memory: bool):
        from torch.utils.tensorboard import SummaryWriter

        self.logdir = logdir
        self.log_memory = log_memory
        self._writer = SummaryWriter(log_dir=str(logdir))

    def log_step(self, step: int, figures: dict[str, Any], memory: dict[str, Any]) -> None:
        for name, key in STEP_KEYS.items():
            value = figures.get(name)
            if value is not None:
                self._writer.add_scalar(key, float(value), step)
        if self.log_memory:
            for name, key in MEMORY_KEYS.items():
                if name in memory:
                    self._writer.add_scalar(key, memory[name], step)

    def close(self) -> None:
        self._writer.close()
