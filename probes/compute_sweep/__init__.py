"""Start-up compute sweep: the model's own per-layer work, timed at the run's dtype and TP-local shapes on this device,
so the ledger's time model can predict a step without reading the step times it judges.

What is timed is the catalogue of the rank's stage (common/ops: SweepSpec.ops), entry by entry, one micro-batch at
the rank's shapes: the time model prices exactly these entries, so neither side keeps a list of its own. Each entry
goes to a timed call of its family through the engine's own functions where the engine has them (EngineKernels,
built by engine/probe_adapters.py):

  gemm         every linear's fprop / dgrad / wgrad (the wgrad accumulating into a grad-dtype main_grad through
               the engine's accumulate_weight_grad, gradient-accumulation fusion where the device has it)
  attention    core attention (flash, causal, GQA), or under context parallelism ring attention's two block
               kernels and its merges (the engine's ring loop without exchanges)
  elementwise  norms, residual add, the attention output's copy, rope and swiglu (the engine's fused functions,
               compiled on GPU as the engine compiles them), the GPT style's gelu
  moe          router top-k, permute, unpermute through the engine's router and dispatcher at EP 1
  ends         embedding (first stage), the vocab-parallel cross-entropy (last stage)
  rates        optimizer.step and grad_buffer.zero at up to RATE_NUMEL_CAP elements, scaled by the time model
Random inputs come from a private generator, so the run's own random stream is untouched. How a call is timed:
harness.py; the GPU's clock under sustained load (the "sustained.layer" record): sustained.py.

Records (run-directory events of kind "compute"): op, dims, dtype, seconds, flops, iters, device, threads, variant,
cached. A cache (cache.py) lets a later run on the same machine and shapes skip the measurement;
`--no-compute-sweep-cache` measures anyway and refreshes it.

    records = run(SweepSpec.from_run(cfg, first_stage=..., last_stage=..., optimizer_numel=...,
                                     grad_buffer_numel=...), device, kernels)
"""
from probes.compute_sweep.cache import device_name
from probes.compute_sweep.handles import EngineKernels, MoEKernels, RingKernels
from probes.compute_sweep.planned import Planned, plan
from probes.compute_sweep.spec import SweepSpec
from probes.compute_sweep.sweep import run

__all__ = ["EngineKernels", "MoEKernels", "Planned", "RingKernels", "SweepSpec", "device_name", "plan", "run"]
