#!/usr/bin/env bash
# Issue 19 on one H200 (the commands BENCHMARKS.md quotes): ring attention's CUDA kernels through the in-process ring,
# and a reconciled MoE run (Mixtral 8x7B's layer shape at 2 layers, 8 experts top-2, EP 1: the routing, the expert
# buffers and the memory ledger on a real GPU; EP > 1 needs more GPUs than one).
#     OUT=dir bash runs/bench/moe_cp_h200.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/moe_cp_h200}
mkdir -p "$OUT" runs/out
export NCCL_NVLS_ENABLE=0
[ "${SKIP_RING:-0}" = 1 ] || python3 runs/bench/ring_attention_cuda.py --json "$OUT/ring_attention_cuda.json"
RUN=runs/out/moe_h200
rm -rf "$RUN"
python3 -m cli train --nproc-per-node 1 --model mixtral-8x7b-2l --bf16 --micro-batch-size 1 --global-batch-size 8 \
    --train-iters 12 --moe-aux-loss-coeff 0.02 --all-probes --use-pytorch-profiler \
    --profile-step-start 9 --profile-step-end 10 --run-dir "$RUN"
python3 -m cli reconcile "$RUN"
python3 -m cli report "$RUN" > /dev/null
tar czf "$OUT/moe_h200_run.tgz" -C runs/out moe_h200
