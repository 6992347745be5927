#!/usr/bin/env bash
# Gradient-accumulation fusion on one H200 (BENCHMARKS.md, 2026-12-03), on and off (--no-gradient-accumulation-fusion,
# Megatron's flag), alternated per $ORDER (default "on off on"). SHAPE=s8192-full (the default): llama3.2-1b at seq
# 8192, full recompute of every layer, 8 micro-batches, the h200_llama1b/s8192-full fixture's flags (off: what every
# checkpointed linear ran before commit 6b57d47, when the fusion fell back under recompute); SHAPE=s4096: the Engine VII
# dense shape (seq 4096, no recompute). Each run's directory (without TensorBoard) goes into
# OUT/<SHAPE>_<n>_<on|off>.tar.gz and its steps' median is printed.
#     OUT=dir [SHAPE=s8192-full|s4096] [ORDER="on off on"] [ITERS=8] bash runs/bench/recompute_fusion_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/recompute_fusion}
SHAPE=${SHAPE:-s8192-full}
case "$SHAPE" in
  s8192-full) shape="--seq-length 8192 --recompute-granularity full --recompute-method uniform --recompute-num-layers 1" ;;
  s4096) shape="--seq-length 4096" ;;
  *) echo "SHAPE must be s8192-full or s4096, got $SHAPE" >&2; exit 2 ;;
esac
source runs/bench/device_setup.sh
n=0
for mode in ${ORDER:-on off on}; do
  n=$((n + 1)); dir="/tmp/${SHAPE}_${n}_$mode"; rm -rf "$dir"
  fusion=""; [ "$mode" = off ] && fusion=--no-gradient-accumulation-fusion
  python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
    -m engine.train --model llama3.2-1b $shape --bf16 --use-distributed-optimizer --micro-batch-size 1 \
    --global-batch-size 8 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 1 --weight-decay 0.1 --clip-grad 1.0 \
    --all-probes --train-iters "${ITERS:-8}" $fusion --run-dir "$dir" > "$dir.log" 2>&1
  echo "run $n fusion $mode exit $?"
  step_summary "$dir.log"
  mv "$dir.log" "$dir/"
  tar czf "$OUT/${SHAPE}_${n}_$mode.tar.gz" --exclude tb -C /tmp "$(basename "$dir")"
done
