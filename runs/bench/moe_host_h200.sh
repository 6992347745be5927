#!/usr/bin/env bash
# The MoE step's host stalls at new expert row counts (BENCHMARKS.md, 2026-12-03), on one H200. PARTS, in order:
#   shapes  runs/bench/gemm_shape_host.py: torch.mm's host time at row counts new to the process, seen, and rounded
#           up to a multiple, with CUDA's lazy module loading (the default) and with CUDA_MODULE_LOADING=EAGER
#   moe     mixtral-8x7b-2l (seq 4096, micro-batch 1, 8 micro-batches, --all-probes), $ITERS steps, once with lazy
#           loading and once with CUDA_MODULE_LOADING=EAGER; the step times of each
# PARTS must not be empty (an empty PARTS means the default).   OUT=dir [PARTS="shapes moe"] [ITERS=16] bash this
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/moe_host_h200}
PARTS=${PARTS:-shapes moe}
source runs/bench/device_setup.sh

shapes() {
  python3 runs/bench/gemm_shape_host.py > "$OUT/gemm_shape_host_lazy.txt" 2>&1
  CUDA_MODULE_LOADING=EAGER python3 runs/bench/gemm_shape_host.py > "$OUT/gemm_shape_host_eager.txt" 2>&1
  tail -n 5 "$OUT"/gemm_shape_host_*.txt
}
moe_run() {  # $1: lazy | eager
  local env=(); [ "$1" = eager ] && env=(CUDA_MODULE_LOADING=EAGER)
  env ${env[@]+"${env[@]}"} python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m engine.train \
    --model mixtral-8x7b-2l --bf16 --micro-batch-size 1 --global-batch-size 8 --moe-aux-loss-coeff 0.02 \
    --all-probes --train-iters "${ITERS:-16}" --run-dir "/tmp/moe_$1" > "$OUT/moe_$1.log" 2>&1
  echo "moe $1 exit $?"; grep -o "iteration *[0-9]*/.*step time (ms): [0-9.]*" "$OUT/moe_$1.log" | sed 's/|.*step/ step/'
}
moe() { moe_run lazy; moe_run eager; }
for part in $PARTS; do "$part"; done
