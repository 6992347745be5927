"""Where a training rank's memory outside PyTorch goes beyond the formula's terms: the engine's dense one-GPU run
(llama3.2-1b untied, seq 4096, micro-batch 1, 8 micro-batches, bf16, distributed optimizer) with and without its
start-up sweeps and its compiled fusions, NVML's used bytes less the allocator's reserved at every sample.

    python runs/bench/outside_pytorch_engine.py --out result.json [--steps 6]

Variants (each a torchrun launch of engine.train in its own run directory, NVML sampled every 0.5 s):
  all-probes         --all-probes (compute, bandwidth and host sweeps, timers, NVTX, NVML), compiled: Engine VII's run
  all-probes-eager   the same with TRAIN_LEDGER_COMPILE=0
  nvml               NVML only, compiled
  nvml-eager         NVML only, eager
Each prints NVML used at its highest, reserved at its highest, outside = their difference (as vs_megatron.py), and
the ledger's predicted outside-PyTorch terms for the config (ledger/models/formulas/device_memory.py).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "runs" / "bench"))

from vs_megatron import engine_argv, engine_run  # noqa: E402

from common.arguments import parse_args  # noqa: E402
from ledger.models.formulas.device_memory import DeviceOverheads, outside_pytorch  # noqa: E402

SEQ, MICROBATCHES = 4096, 8
EAGER = {"TRAIN_LEDGER_COMPILE": "0"}
NVML = ("--nvml-interval", "0.5")
VARIANTS = {"all-probes": (("--all-probes",), {}), "all-probes-eager": (("--all-probes",), EAGER),
            "nvml": (NVML, {}), "nvml-eager": (NVML, EAGER)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--steps", type=int, default=6)
    a = ap.parse_args()
    print("command: python " + " ".join(sys.argv), flush=True)
    cfg = parse_args(engine_argv(SEQ, MICROBATCHES, a.steps, "unused", probes=NVML), world_size=1)
    h200 = DeviceOverheads.known("NVIDIA H200")
    predicted = outside_pytorch(cfg, 0, h200)
    out = {"predicted": predicted.terms, "predicted_total": predicted.total, "variants": {}}
    print(f"predicted outside PyTorch: {predicted.total / 2**30:.3f} GiB = "
          + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in predicted.terms.items()), flush=True)
    for name, (flags, env) in VARIANTS.items():
        with tempfile.TemporaryDirectory() as tmp:
            r = engine_run(engine_argv(SEQ, MICROBATCHES, a.steps, str(Path(tmp) / "run"), flags), timed=2, env=env)
        keep = {k: r[k] for k in ("nvml_used_max", "peak_reserved", "outside_pytorch", "peak_alloc", "wall_s", "argv")}
        out["variants"][name] = keep
        print(f"{name:18s} NVML used max {keep['nvml_used_max'] / 2**30:.3f} GiB, reserved max "
              f"{keep['peak_reserved'] / 2**30:.3f} GiB, outside {keep['outside_pytorch'] / 2**30:.3f} GiB "
              f"(predicted {predicted.total / 2**30:.3f}); {keep['wall_s']:.0f} s", flush=True)
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
