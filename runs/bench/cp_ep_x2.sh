#!/usr/bin/env bash
# Issue 19's two-GPU runs, for the first `nvidia-h200-x2` call (not yet run on GPUs: none was lent when it was
# written; a CPU dry run checks the commands: `CPU=1 bash runs/bench/cp_ep_x2.sh`). Each run is reconciled and tarred:
#   cp2: llama3.2-1b at seq 16384 over 2 GPUs (ring attention over NVLink; the ring's volume, its hidden share and
#        the activations at s/2 judged), every probe, the profiler window for the HTA cross-check;
#   ep2: Mixtral 8x7B's layer at 2 layers, 4 experts a GPU (the all-to-all over NVLink judged).
#     OUT=dir bash runs/bench/cp_ep_x2.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/cp_ep_x2}
mkdir -p "$OUT" runs/out
export NCCL_NVLS_ENABLE=0
if [ "${CPU:-0}" = 1 ]; then  # the same commands on gloo with the tiny model: a check of the script, not a figure
  CP=(--model tiny --context-parallel-size 2 --global-batch-size 2 --train-iters 6)
  EP=(--model tiny --num-experts 4 --expert-model-parallel-size 2 --global-batch-size 4 --train-iters 6)
  WINDOW=(--profile-step-start 4 --profile-step-end 5)
else
  CP=(--model llama3.2-1b --bf16 --use-distributed-optimizer --context-parallel-size 2 --seq-length 16384
      --max-position-embeddings 16384 --global-batch-size 8 --train-iters 12)
  EP=(--model mixtral-8x7b-2l --bf16 --use-distributed-optimizer --expert-model-parallel-size 2
      --moe-aux-loss-coeff 0.02 --global-batch-size 16 --train-iters 12)
  WINDOW=(--profile-step-start 9 --profile-step-end 10)
fi
for name in cp2 ep2; do
  RUN=runs/out/x2_$name
  rm -rf "$RUN"
  if [ $name = cp2 ]; then FLAGS=("${CP[@]}"); else FLAGS=("${EP[@]}"); fi
  python3 -m cli train --nproc-per-node 2 "${FLAGS[@]}" --all-probes --use-pytorch-profiler "${WINDOW[@]}" \
      --profile-ranks 0 1 --run-dir "$RUN" > "$OUT/$name.log" 2>&1
  python3 -m cli reconcile "$RUN" >> "$OUT/$name.log" 2>&1
  python3 -m cli report "$RUN" > /dev/null
  tar czf "$OUT/$name.tgz" -C runs/out "x2_$name"
  tail -3 "$OUT/$name.log"
done
