#!/usr/bin/env bash
# The grouped experts' GEMMs in a whole step, grouped (the engine's) or one cuBLAS mm per expert in backward or in
# both passes (runs/bench/expert_gemm_step.py), on one H200: mixtral-8x7b-2l (seq 4096, micro-batch 1, 8
# micro-batches, aux loss 0.02, --moe-grouped-gemm --moe-delay-expert-wgrad, --timers), ITERS steps each (default 12),
# the variants alternated ROUNDS times (default 2); each run's steps after the first (min, median, max) in
# $OUT/expert_gemm_step.log, each run's log beside it.
#     OUT=dir [ROUNDS=2] [ITERS=12] bash runs/bench/expert_gemm_step_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/expert_gemm_step_h200}
source runs/bench/device_setup.sh
for round in $(seq "${ROUNDS:-2}"); do
  for variant in grouped cublas-dgrad cublas-both; do
    log="$OUT/${variant}_$round.log"
    rm -rf "/tmp/expert_gemm_step_${variant}_$round"  # a warm machine keeps the last call's
    python3 -m torch.distributed.run --standalone --nproc-per-node 1 runs/bench/expert_gemm_step.py \
      --variant "$variant" --model mixtral-8x7b-2l --bf16 --micro-batch-size 1 --global-batch-size 8 \
      --moe-aux-loss-coeff 0.02 --moe-grouped-gemm --moe-delay-expert-wgrad --timers --train-iters "${ITERS:-12}" \
      --run-dir "/tmp/expert_gemm_step_${variant}_$round" > "$log" 2>&1
    echo "$variant round $round: exit $?" | tee -a "$OUT/expert_gemm_step.log"
    step_summary "$log" | tee -a "$OUT/expert_gemm_step.log"
  done
done
