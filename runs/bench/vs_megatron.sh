#!/usr/bin/env bash
# The issue-9 benchmark on one GPU machine, as run for BENCHMARKS.md: megatron-core vs torch.compile vs our engine,
# alternated A B C A B C at seq 4096 and 8192 (the harnesses: runs/bench/anchors). Prepare once, in the project root,
# on a machine with network, the megatron-core wheel in .whl/ (git-ignored; the command: runs/bench/anchors/README.md),
# then run this script on the GPU machine (with .whl/ beside the project). Results: $OUT or ./bench-out.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-bench-out}"
source runs/bench/device_setup.sh
for seq in 4096 8192; do
  python3 runs/bench/vs_megatron.py --seq "$seq" --rounds 2 --variants ours mcore compile \
    --steps 10 --timed 6 --out "$OUT/vs_megatron_$seq.json"
done
