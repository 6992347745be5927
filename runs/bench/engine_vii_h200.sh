#!/usr/bin/env bash
# Engine VII on one H200 in one device call (under 9 minutes): the dense llama3.2-1b comparison with megatron-core at
# seq 4096 (ours, ours with the fused linear cross-entropy, mcore; 2 rounds), the mixtral-8x7b-2l MoE run with
# SequentialMLP and with --moe-grouped-gemm (forward GPU idle from a profiled step's trace), a launch-bound small
# shape eager and compiled, and memory outside PyTorch on one GPU. runs/bench/engine_vii.py says what each section
# measures; every run's exact command is printed before it starts. Prepare once, as runs/bench/vs_megatron.sh says:
# .whl/ holds the megatron-core wheel and its dependencies (runs/bench/anchors/README.md). Then, on the GPU machine:
#     OUT=dir bash runs/bench/engine_vii_h200.sh        # BUDGET_S=seconds to stop starting runs (default 470)
# ARGS adds engine_vii.py flags, e.g. ARGS="--sections moe --moe-variants grouped-gemm mcore --steps 8 --timed 4".
# Results: OUT/engine_vii.json (rewritten after every run) and OUT/engine_vii.log.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/engine_vii}
source runs/bench/device_setup.sh
nvidia-smi --query-gpu=name,memory.used,memory.total,driver_version --format=csv | tee "$OUT/nvidia_smi.csv"
python3 runs/bench/engine_vii.py --out "$OUT/engine_vii.json" --budget-s "${BUDGET_S:-470}" ${ARGS:-} 2>&1 \
  | tee "$OUT/engine_vii.log"
