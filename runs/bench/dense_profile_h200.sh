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
# vs_megatron.py's own engine flags (engine_argv), so that this step stays the shape that script compares
FLAGS=$(python3 -c "import sys; sys.path.insert(0, 'runs/bench'); from vs_megatron import engine_argv
print(' '.join(engine_argv(4096, 8, $ITERS, '/tmp/dense_run')))")
# shellcheck disable=SC2086  # FLAGS holds no spaces inside a flag
python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m engine.train $FLAGS --use-pytorch-profiler \
  --profile-step-start $((ITERS - 1)) --profile-step-end $((ITERS - 1)) > "$OUT/dense_run.log" 2>&1
echo "dense run exit $?"
grep -o "iteration *[0-9]*/.*" "$OUT/dense_run.log" | sed 's/| learning rate[^|]*|//'
tar czf "$OUT/dense_run.tgz" --exclude tb -C /tmp dense_run
