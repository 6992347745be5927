"""A GPU kind's prices of a layout, memoised: what `simulate`, `search` and the benchmark ask of a hardware file.

    pricing = Pricing(load_hardware("H200"))
    pricing.calibration(cfg)      # ledger.models.time_model.Calibration of cfg's kernels, rates and groups
    pricing.outside_bytes(cfg)    # memory outside PyTorch on a rank (device_memory.py with the file's overheads)
    pricing.fits(cfg)             # True, or why not (a step the time model walks, search.memory_fit against the HBM)
    pricing.predict(cfg)          # ledger.models.time_model.StepPrediction
    pricing.search(base, gpus, top)   # search.SearchResult: the layouts of base on gpus GPUs, best first

Why memoised: a search asks for the same layout's calibration twice (its bound, then its score), and the number of
NCCL communicators a rank holds depends on (tp, pp, cp) only but takes milliseconds to derive from the rank groups
at 1,024 ranks: without the cache the memory filter of a 70B / 1,024-GPU search takes 44 s instead of 1.5 s.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from common.config import RunConfig
from ledger.models.simulate.bound import calibrated_bound
from ledger.models.simulate.calibration import hardware_calibration
from ledger.models.simulate.hardware import Hardware
from ledger.models.simulate.search import SearchResult, memory_fit, search
from ledger.models.simulate.simulation import outside_bytes, walkable
from ledger.models.time_model import Calibration, StepPrediction, predict_step


@dataclass
class Pricing:
    hardware: Hardware
    _outside: dict[tuple[int, int, int, int], int] = field(default_factory=dict)
    _calibrations: dict[int, tuple[RunConfig, Calibration]] = field(default_factory=dict)
    _memory: Callable[[RunConfig], bool | str] = field(init=False)

    def __post_init__(self) -> None:
        self._memory = memory_fit(self.hardware.hbm_bytes, self.outside_bytes)

    def fits(self, cfg: RunConfig) -> bool | str:
        """True, or why not: a step the time model walks (simulation.walkable) within the HBM (search.memory_fit)."""
        reason = walkable(cfg)
        return self._memory(cfg) if reason is True else reason

    def outside_bytes(self, cfg: RunConfig) -> int:
        p = cfg.parallel
        key = (p.world_size, p.tensor_model_parallel_size, p.pipeline_model_parallel_size, p.context_parallel_size)
        if key not in self._outside:
            self._outside[key] = outside_bytes(cfg, self.hardware)
        return self._outside[key]

    def calibration(self, cfg: RunConfig) -> Calibration:
        found = self._calibrations.get(id(cfg))
        if found is None or found[0] is not cfg:
            found = self._calibrations[id(cfg)] = (cfg, hardware_calibration(cfg, self.hardware))  # cfg kept alive
        return found[1]

    def predict(self, cfg: RunConfig) -> StepPrediction:
        return predict_step(cfg, self.calibration(cfg))

    def search(self, base: RunConfig, gpus: int, top: int, **enumerate_options) -> SearchResult:
        """search.search on this hardware: fits against its HBM, scored by the time model, pruned by the bound
        calibrated on the same kernels (bound.py: never below a layout's score, so the top K is exact). An MoE base
        keeps its EP size in every layout (ledger/models/simulate/layouts.py does not enumerate it)."""
        return search(base, gpus, self.fits, self.predict, top, gpus_per_node=self.hardware.gpus_per_node,
                      bound=calibrated_bound(self.calibration), **enumerate_options)
