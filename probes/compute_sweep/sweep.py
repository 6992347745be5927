"""The sweep's entry: plan the rank's ops, read them from the cache or time them, and return the `compute`
records (op, dims, dtype, seconds, flops, iters, device, threads, variant, cached; on GPU also the sustained.layer
record)."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from probes.compute_sweep import cache
from probes.compute_sweep.handles import EngineKernels
from probes.compute_sweep.harness import median_seconds
from probes.compute_sweep.planned import plan
from probes.compute_sweep.spec import SweepSpec
from probes.compute_sweep.sustained import sustained_layer


def run(spec: SweepSpec, device: torch.device, kernels: EngineKernels, *, use_cache: bool = True,
        warmup: int | None = None, iters: int | None = None, keep: Callable[[str], bool] | None = None,
        before: Callable[[], None] | None = None) -> list[dict[str, Any]]:
    """This rank's `compute` records: from the cache when it holds this machine and shape (and use_cache), else
    measured now and written to the cache. `keep` (an op name's test) times only the ops it keeps, and then no
    sustained-layer record (that needs the whole layer's kernels); `before` runs ahead of each timed call (an
    experiment's, runs/bench/l2_state.py: its records are not the sweep's, so the cache is neither read nor written)."""
    cuda = device.type == "cuda"
    warmup = warmup if warmup is not None else (3 if cuda else 1)
    iters = iters if iters is not None else (10 if cuda else 3)
    planned = [p for p in plan(spec, device, kernels) if keep is None or keep(p.op)]
    key = cache.cache_key(planned, device, kernels)
    found = cache.cached(key) if use_cache and before is None else None
    if found is not None:
        return [{**r, "cached": True} for r in found]
    records = [{"op": p.op, "dims": p.dims, "dtype": p.dtype, "flops": p.flops, "iters": iters,
                "seconds": median_seconds(p.build(), warmup, iters, cuda, before)} for p in planned]
    if cuda and keep is None:
        records.append(sustained_layer(planned, [r["seconds"] for r in records]))
    records = [{**r, "device": key["device"], "threads": torch.get_num_threads(), "variant": kernels.variant}
               for r in records]
    if cuda:
        torch.cuda.empty_cache()  # the sweep's buffers leave no reserved memory behind
    if before is None:
        cache.store(key, records)
    return [{**r, "cached": False} for r in records]
