#!/usr/bin/env bash
# One profiled step of issue Engine VII's dense shape on one H200 (vs_megatron.py's engine flags: llama3.2-1b untied,
# seq 4096, micro-batch 1, 8 micro-batches, bf16, distributed optimizer, --all-probes), so that the ledger can say
# where the step's time goes at the shape whose MFU the issue asks about: $ITERS steps (default 8), the profiler over
# step ITERS-1 (the trace holds that step and the next). The run directory (no TensorBoard) in $OUT/dense_run.tgz,
# the log in $OUT/dense_run.log.
#     OUT=dir [ITERS=8] bash runs/bench/dense_profile_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/dense_profile_h200}
source runs/bench/device_setup.sh
ITERS=${ITERS:-8}
rm -rf /tmp/dense_run
python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m engine.train \
  --model llama3.2-1b --untie-embeddings-and-output-weights --seq-length 4096 --bf16 --use-distributed-optimizer \
  --micro-batch-size 1 --global-batch-size 8 --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 1 --weight-decay 0.1 \
  --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --all-probes --train-iters "$ITERS" --use-pytorch-profiler \
  --profile-step-start $((ITERS - 1)) --profile-step-end $((ITERS - 1)) --run-dir /tmp/dense_run \
  > "$OUT/dense_run.log" 2>&1
echo "dense run exit $?"
grep -o "iteration *[0-9]*/.*" "$OUT/dense_run.log" | sed 's/| learning rate[^|]*|//'
tar czf "$OUT/dense_run.tgz" --exclude tb -C /tmp dense_run
