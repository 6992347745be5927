#!/usr/bin/env bash
# --no-gradient-accumulation-fusion against the default on one H200 (BENCHMARKS.md, 2026-12-03 "fifteenth"): llama3.2-1b
# at seq 4096 (the Engine VII dense shape: 8 micro-batches, distributed optimizer, every probe on), each order in
# $ORDER (default "off on"); each run's directory (without TensorBoard) goes into OUT/s4096_<n>_<off|on>.tar.gz and its
# steps' median is printed. The seq-8192 full-recompute pair is runs/bench/recompute_fusion_h200.sh.
#     OUT=dir [ORDER="off on"] [ITERS=8] bash runs/bench/unfused_wgrad_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/unfused_wgrad}
source runs/bench/device_setup.sh
n=0
for mode in ${ORDER:-off on}; do
  n=$((n + 1)); dir="/tmp/unfused_s4096_${n}_$mode"; rm -rf "$dir"
  fusion=""; [ "$mode" = off ] && fusion=--no-gradient-accumulation-fusion
  python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
    -m engine.train --model llama3.2-1b --seq-length 4096 --bf16 --use-distributed-optimizer --micro-batch-size 1 \
    --global-batch-size 8 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 1 --weight-decay 0.1 --clip-grad 1.0 \
    --all-probes --train-iters "${ITERS:-8}" $fusion --run-dir "$dir" > "$dir.log" 2>&1
  echo "run $n fusion $mode exit $?"
  grep -o "step time (ms): [0-9.]*" "$dir.log" | tail -n +2 | awk '{print $4}' | sort -n \
    | awk '{t[NR] = $1} END {printf "  steps 2-%d: min %.1f median %.1f max %.1f ms\n", NR + 1, t[1], t[int((NR + 1) / 2)], t[NR]}'
  mv "$dir.log" "$dir/"
  tar czf "$OUT/s4096_${n}_$mode.tar.gz" --exclude tb -C /tmp "$(basename "$dir")"
done
