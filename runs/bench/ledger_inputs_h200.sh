#!/usr/bin/env bash
# Real one-H200 runs that the ledger's readers and its host-side work are built and measured on (BENCHMARKS.md says
# which run shaped what): a full-size llama3.2-1b run (16 layers, seq 4096, 8 micro-batches, a 3-step profiler
# window: ~270k trace events, the input of runs/bench/ledger_scale.py) and two launch-bound shapes (kernels too short
# for the host to keep the GPU fed). Each run directory comes back as one .tgz under $OUT, reconciled on the GPU box.
# Needs the wheels of ../.whl (nvtx, pynvml, HolisticTraceAnalysis, msgspec; `python3 -m pip download` them for
# cp312 manylinux x86_64 into .whl/).          OUT=dir bash runs/bench/ledger_inputs_h200.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/ledger_inputs}
source runs/bench/device_setup.sh
run() {
  local name=$1; shift
  rm -rf "runs/out/$name"
  python3 -m cli train --nproc-per-node 1 --bf16 --use-distributed-optimizer "${ADAM[@]}" --all-probes \
      --use-pytorch-profiler "$@" --run-dir "runs/out/$name" 2>&1 | tail -n 4
  ( time python3 -m cli reconcile "runs/out/$name" > /dev/null ) 2>&1 | grep real || true
  tar czf "$OUT/$name.tgz" -C runs/out "$name"
}
run llama1b_full --model llama3.2-1b --seq-length 4096 --micro-batch-size 1 --global-batch-size 8 --train-iters 9 \
    --profile-step-start 5 --profile-step-end 7
run lb_h1024_l4_s512 --model llama3.2-1b --num-layers 4 --hidden-size 1024 --ffn-hidden-size 4096 \
    --num-attention-heads 16 --num-query-groups 4 --seq-length 512 --max-position-embeddings 512 \
    --micro-batch-size 2 --global-batch-size 8 --train-iters 9 --profile-step-start 5 --profile-step-end 6
run lb_h512_l12_s256 --model llama3.2-1b --num-layers 12 --hidden-size 512 --ffn-hidden-size 2048 \
    --num-attention-heads 8 --num-query-groups 8 --seq-length 256 --max-position-embeddings 256 \
    --micro-batch-size 4 --global-batch-size 16 --train-iters 9 --profile-step-start 5 --profile-step-end 6
ls -la "$OUT"
