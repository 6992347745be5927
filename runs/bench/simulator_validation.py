"""The simulator against every real run we have (issue 18, item 3): predicted vs measured step time, peak memory and
bubble, per run, with the error.

    python runs/bench/simulator_validation.py [--evidence runs/bench/evidence/2gpu-2026-12-01]

1. Every one-GPU run directory committed in the repository (tests/fixtures: each of ours whose manifest names one
   CUDA rank, found by `one_gpu_runs`, and Megatron-LM's own runs, whose event files do not name the GPU: simulated
   on the H200 file, on which they ran), through `train-ledger simulate --validate` (ledger/reconcile/validation.py).
   A run recorded by an older engine is priced as the engine runs now (its fixture's README gives its commit).
2. The real 2-GPU runs (2 H200s, NVLink) committed as reconciliation outputs (runs/bench/evidence/2gpu-2026-12-01:
   rec_<name>.json.gz) and their flags (README.md there): each layout rebuilt from those flags (the engine of that day
   untied the embeddings: --untie-embeddings-and-output-weights), simulated on the H200 file, and judged on the measured
   figures of its reconciliation, as `--validate` judges a run directory.
Prints one markdown table and the command.
"""
from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from cli.simulate import render_validation  # noqa: E402
from common.arguments import parse_args  # noqa: E402
from ledger.models.simulate.hardware import load_hardware  # noqa: E402
from ledger.models.simulate.simulation import simulate  # noqa: E402
from ledger.reconcile.validation import Validation, measured, validate_run  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures"
# Megatron-LM's runs (no manifest) and the GPU kind each ran on
MEGATRON = [(FIXTURES / "megatron_lm_1gpu", "H200"), (FIXTURES / "megatron_lm_h200" / "local_l2_mbs2", "H200"),
            (FIXTURES / "megatron_lm_h200" / "sdpa_l4_mbs2", "H200"),
            *((FIXTURES / "megatron_lm_h100" / case, "H100")
              for case in ("local_l2_mbs1", "local_l2_mbs2", "sdpa_l4_mbs1", "sdpa_l4_mbs2"))]
# The 2-GPU evidence's flags (its README): common to every run, then each run's layout and world size.
EVIDENCE_COMMON = ["--model", "llama3.2-1b", "--seq-length", "4096", "--bf16", "--use-distributed-optimizer",
                   "--micro-batch-size", "1", "--untie-embeddings-and-output-weights"]
EVIDENCE = {
    "g1": (1, ["--global-batch-size", "8"]),
    "dp2": (2, ["--global-batch-size", "16", "--overlap-grad-reduce", "--overlap-param-gather"]),
    "dp2nooverlap": (2, ["--global-batch-size", "16"]),
    "tp2": (2, ["--global-batch-size", "8", "--tensor-model-parallel-size", "2", "--sequence-parallel"]),
    "pp2": (2, ["--global-batch-size", "8", "--pipeline-model-parallel-size", "2"]),
}


def one_gpu_runs(root: Path) -> list[Path]:
    """Every run directory under `root` whose manifest has one rank, on a CUDA device."""
    runs = []
    for manifest in sorted(root.rglob("manifest.json")):
        ranks = json.loads(manifest.read_text()).get("ranks") or []
        if len(ranks) == 1 and (ranks[0].get("device") or {}).get("type") == "cuda":
            runs.append(manifest.parent)
    return runs


def evidence_run(folder: Path, name: str) -> Validation:
    world, flags = EVIDENCE[name]
    cfg = parse_args([*EVIDENCE_COMMON, *flags], world_size=world)
    rows = json.loads(gzip.open(folder / f"rec_{name}.json.gz", "rt").read())["rows"]
    return Validation(run=f"2-GPU evidence: {name}", framework="train-ledger", sim=simulate(cfg, load_hardware("H200")),
                      measured=measured(rows, "NVIDIA H200"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--evidence", type=Path, default=ROOT / "runs" / "bench" / "evidence" / "2gpu-2026-12-01")
    args = ap.parse_args()
    results = [validate_run(run) for run in one_gpu_runs(FIXTURES)] + [validate_run(run, gpu) for run, gpu in MEGATRON]
    if args.evidence.is_dir():
        results += [evidence_run(args.evidence, name) for name in EVIDENCE]
    else:
        print(f"(no 2-GPU evidence at {args.evidence}: those rows are left out)")
    table = render_validation(results)
    print(table.replace(str(ROOT) + "/", ""))
    evidence = str(args.evidence.resolve()).replace(str(ROOT) + "/", "")
    print(f"command: python3 runs/bench/simulator_validation.py --evidence {evidence}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
