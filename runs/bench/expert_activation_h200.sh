#!/usr/bin/env bash
# SequentialMLP's expert SwiGLU compiled for any row count (the engine's) or eager, on one H200
# (runs/bench/expert_activation.py): mixtral-8x7b-2l (seq 4096, micro-batch 1, 8 micro-batches, aux loss 0.02,
# --timers), ITERS steps each (default 10), the variants alternated ROUNDS times (default 2); each run's steps after
# the first (min, median, max) in $OUT/expert_activation.log, the logs in $OUT/expert_activation_logs.tgz.
#     OUT=dir [ROUNDS=2] [ITERS=10] bash runs/bench/expert_activation_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/expert_activation_h200}
source runs/bench/device_setup.sh
mkdir -p runs/out/expert_activation
for round in $(seq "${ROUNDS:-2}"); do
  for variant in compiled eager; do
    log="runs/out/expert_activation/${variant}_$round.log"
    rm -rf "/tmp/expert_activation_${variant}_$round"  # a warm machine keeps the last call's
    python3 -m torch.distributed.run --standalone --nproc-per-node 1 runs/bench/expert_activation.py \
      --variant "$variant" --model mixtral-8x7b-2l --bf16 --micro-batch-size 1 --global-batch-size 8 \
      --moe-aux-loss-coeff 0.02 --timers --train-iters "${ITERS:-10}" --run-dir "/tmp/expert_activation_${variant}_$round" \
      > "$log" 2>&1
    echo "$variant round $round: exit $?" | tee -a "$OUT/expert_activation.log"
    step_summary "$log" | tee -a "$OUT/expert_activation.log"
  done
done
tar czf "$OUT/expert_activation_logs.tgz" -C runs/out expert_activation
