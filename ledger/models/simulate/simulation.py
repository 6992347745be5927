"""One layout on one kind of GPU, predicted: memory per stage against the device, the step with its breakdown,
tokens/s, TFLOP/s and MFU under both conventions, and the textbook figures beside them. Torch-free.

    sim = simulate(cfg, load_hardware("H200"))      # cfg: Megatron flags resolved with --world-size N
    sim.fits, sim.step.step_time, sim.to_dict()

Memory is the ledger's own (ledger/models/formulas/peak_memory.py: static of the largest DP rank + the hardware file's
allocator workspaces and Megatron-LM's global buffer + the step's largest phase: this engine's saved activations at the
schedule's peak or its last stage's loss and output-layer backwards; Megatron-LM's layers with their transients) plus
the outside-PyTorch estimate of the hardware file's overheads (ledger/models/formulas/device_memory.py: driver, CUDA
context, one NCCL communicator per group the rank joins, library modules), against the file's HBM. Time is
ledger.models.time_model.predict_step on the Calibration the hardware file gives
(ledger/models/simulate/calibration.py): the same replay that reconciles our runs, priced from a datasheet and our
sweeps instead of the run's own sweep, so its error is the one `simulate --validate` measures on every real run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from common.config import RunConfig
from common.errors import ConfigError
from ledger.models.formulas import bubble, flops
from ledger.models.formulas.activations import recompute_label
from ledger.models.formulas.bytes_per_param import run_strategy
from ledger.models.formulas.comm import ep_collectives
from ledger.models.formulas.device_memory import outside_pytorch
from ledger.models.formulas.params import (
    active_params,
    num_chunks,
    params_per_rank_split,
    params_total,
)
from ledger.models.formulas.peak_memory import StagePeak, stage_peaks
from ledger.models.formulas.static_memory import largest_dp_rank, static_bytes_split
from ledger.models.simulate.calibration import hardware_calibration
from ledger.models.simulate.hardware import Hardware
from ledger.models.simulate.topology import group_spans
from ledger.models.time_model import StepPrediction, predict_step

# The time model walks every micro-batch of a stage on its host and device clocks (about 0.6 ms each on a 2-core
# machine): a step of more micro-batches a data-parallel replica than this is refused rather than walked for minutes.
MAX_MICROBATCHES = 16_384


@dataclass(frozen=True)
class StageMemory:
    stage: int
    peak: StagePeak  # static + activations: what PyTorch's allocator holds at the peak
    outside_pytorch: int  # driver, context, NCCL communicators, library modules

    @property
    def total(self) -> int:
        return self.peak.total + self.outside_pytorch


@dataclass(frozen=True)
class Simulation:
    cfg: RunConfig
    hardware: Hardware
    memory: tuple[StageMemory, ...]
    step: StepPrediction

    @property
    def gpus(self) -> int:
        return self.cfg.parallel.world_size

    @property
    def fits(self) -> bool:
        return all(m.total <= self.hardware.hbm_bytes for m in self.memory)

    @property
    def model_flops_per_step(self) -> dict[str, float]:
        tokens = flops.tokens_per_step(self.cfg)
        return {"megatron": float(flops.megatron_flops_per_step(self.cfg)),
                "palm_6n": float(flops.palm_flops_per_token(self.cfg) * tokens)}

    def tflops_per_gpu(self) -> dict[str, float]:
        return {k: v / self.step.step_time / self.gpus / 1e12 for k, v in self.model_flops_per_step.items()}

    def mfu(self) -> dict[str, float]:
        peak = self.hardware.peak(self.cfg.train.params_dtype)
        return {k: flops.mfu(v, self.step.step_time, self.gpus, peak) for k, v in self.model_flops_per_step.items()}

    def to_dict(self) -> dict[str, Any]:
        cfg, hw, step = self.cfg, self.hardware, self.step
        p = cfg.parallel
        b = bubble.bubble(p.pipeline_model_parallel_size, cfg.num_microbatches, num_chunks(cfg))
        return {
            "hardware": {"name": hw.name, "version": hw.version, "file": hw.path, "hbm_bytes": hw.hbm_bytes,
                         "gpus_per_node": hw.gpus_per_node, "peak_flops": hw.peak(cfg.train.params_dtype)},
            "layout": layout_dict(cfg),
            "groups": {kind: {"size": span.size, "nodes": span.nodes, "link": span.link}
                       for kind, span in group_spans(cfg, hw.gpus_per_node).items()},
            "params": params_total(cfg),
            **({"moe": self.moe_dict()} if cfg.model.is_moe else {}),
            "memory": {"fits": self.fits, "per_stage": [{
                "stage": m.stage, "static": m.peak.static.total, "persistent": m.peak.persistent,
                "activations": m.peak.activations, "peak_phase": m.peak.phase.name,
                "outside_pytorch": m.outside_pytorch,
                "total": m.total, "of_hbm": m.total / hw.hbm_bytes} for m in self.memory]},
            "step": {"step_time_s": step.step_time, "terms_s": step.terms, "critical_stage": step.critical_stage,
                     "power_limit_factor": step.power_factor,
                     "per_stage": [{"stage": s.stage, "forward_s": s.compute.forward, "backward_s": s.compute.backward,
                                    "bubble": s.bubble, "exposed_comm_s": s.exposed, "optimizer_s": s.optimizer}
                                   for s in step.stages],
                     "notes": list(step.notes)},
            "throughput": {"tokens_per_step": flops.tokens_per_step(cfg), "tokens_per_s": step.tokens_per_s,
                           "tflops_per_gpu": self.tflops_per_gpu(), "mfu": self.mfu(),
                           "conventions": {"megatron": flops.MEGATRON, "palm_6n": flops.PALM_6N}},
            "textbook": {"bubble_of_wall_time": b.of_wall_time, "bubble_convention": bubble.OF_WALL_TIME,
                         "bubble_relative_to_compute": b.relative_to_compute},
        }


    def moe_dict(self) -> dict[str, Any]:
        """Dense and expert parameters and static bytes per stage (one rank: tp 0, the stage's largest dp x cp
        rank), the all-to-all volume under uniform routing and its time on the ep link (inside the passes: the
        replay's exposed "ep"; the step's is the busiest stage's)."""
        cfg = self.cfg
        per_stage = []
        for s in range(cfg.parallel.pipeline_model_parallel_size):
            split = static_bytes_split(cfg, 0, s, largest_dp_rank(cfg, s)[0])
            a2a = ep_collectives(cfg, s)
            per_stage.append({"stage": s, "params": params_per_rank_split(cfg, s),
                              "static_bytes": {k: b.total for k, b in split.items()},
                              "all_to_all_bytes": sum(c.size_bytes for c in a2a.values()),
                              "all_to_all_remote_bytes": sum(c.bytes_per_rank for c in a2a.values()),
                              "all_to_all_calls": sum(c.calls for c in a2a.values()),
                              "all_to_all_s": self.step.stages[s].exposed.get("ep", 0.0)})
        m = cfg.model
        return {"num_experts": m.num_experts, "topk": m.moe_router_topk, "ep": cfg.parallel.expert_model_parallel_size,
                "expert_dp": cfg.parallel.expert_data_parallel_size, "params_active": active_params(cfg),
                "all_to_all_step_s": max(s["all_to_all_s"] for s in per_stage), "per_stage": per_stage}


def layout_dict(cfg: RunConfig) -> dict[str, Any]:
    p, t = cfg.parallel, cfg.train
    return {"world_size": p.world_size, "tp": p.tensor_model_parallel_size, "pp": p.pipeline_model_parallel_size,
            "vpp": p.virtual_pipeline_model_parallel_size, "cp": p.context_parallel_size, "dp": p.data_parallel_size,
            "ep": p.expert_model_parallel_size,
            "sequence_parallel": p.sequence_parallel, "micro_batch_size": t.micro_batch_size,
            "global_batch_size": t.global_batch_size, "num_microbatches": cfg.num_microbatches,
            "seq_length": cfg.model.seq_length, "recompute": recompute_label(cfg.recompute),
            "strategy": run_strategy(cfg), "params_dtype": t.params_dtype}


def outside_bytes(cfg: RunConfig, hw: Hardware) -> int:
    """Device memory outside PyTorch on a rank of cfg (device_memory.py with the hardware file's overheads)."""
    return outside_pytorch(cfg, 0, hw.overheads).total


def stage_memory(cfg: RunConfig, hw: Hardware) -> tuple[StageMemory, ...]:
    """Each stage's peak plus what lies outside PyTorch on the stage's first rank (every rank joins one group of
    each kind, so any rank gives the same count)."""
    outside = outside_bytes(cfg, hw)
    peaks = stage_peaks(cfg, workspaces=hw.overheads.allocator_workspaces)
    return tuple(StageMemory(stage=i, peak=peak, outside_pytorch=outside) for i, peak in enumerate(peaks))


def walkable(cfg: RunConfig) -> bool | str:
    """True, or why the time model will not walk cfg's step (a `fits` reason for search: "kind: detail")."""
    m = cfg.num_microbatches
    if m <= MAX_MICROBATCHES:
        return True
    return (f"too many micro-batches: global batch {cfg.train.global_batch_size:,} at micro-batch "
            f"{cfg.train.micro_batch_size} over {cfg.parallel.data_parallel_size} data-parallel replica(s) is {m:,} a "
            f"replica; the time model walks each, at most {MAX_MICROBATCHES:,}")


def simulate(cfg: RunConfig, hw: Hardware) -> Simulation:
    """Memory from cfg itself; time from the time model (an MoE model's experts, router, permutes and all-to-alls
    are ops of its passes: ledger/models/time_model/ops.py). ConfigError where the step is not walkable."""
    reason = walkable(cfg)
    if reason is not True:
        raise ConfigError(reason)
    return Simulation(cfg=cfg, hardware=hw, memory=stage_memory(cfg, hw),
                      step=predict_step(cfg, hardware_calibration(cfg, hw)))
