#!/usr/bin/env bash
# Where the host is in an unprofiled step, on one H200: each run below with --all-probes (its own compute and host
# sweeps; the timers now keep each range's host times beside its device times) and no profiler, so that the time
# model's host timeline is judged per forward and backward range (time.host_{forward,backward}_per_microbatch) on
# steps the profiler did not slow. The run directories (no TensorBoard) in $OUT/host_ranges.tgz, each run's last
# lines in $OUT/host_ranges.log; then runs/bench/swiglu_kernels.py (issue Engine VII's SwiGLU formulations) into
# $OUT/swiglu_kernels.txt. About 5 minutes. PARTS="moe" runs instead mixtral-8x7b-2l (SequentialMLP at EP 1, its
# token counts read on the host every layer) and the same with --moe-grouped-gemm (counts kept on the device), 8
# iterations each, into $OUT/host_ranges_moe.tgz (about 3 minutes).
#     OUT=dir [PARTS="dense moe"] bash runs/bench/host_ranges_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/host_ranges_h200}
source runs/bench/device_setup.sh
LB512=(--model llama3.2-1b --num-layers 12 --hidden-size 512 --ffn-hidden-size 2048 --num-attention-heads 8
       --num-query-groups 8 --seq-length 256 --max-position-embeddings 256 --micro-batch-size 4 --global-batch-size 16)
NAMES=()
train() {
  local name=$1 iters=$2; shift 2
  rm -rf "runs/out/$name"
  local t0=$SECONDS
  { python3 -m cli train --nproc-per-node 1 --bf16 --use-distributed-optimizer "${ADAM[@]}" --all-probes \
      --train-iters "$iters" "$@" --run-dir "runs/out/$name" 2>&1 | tail -n 2
    echo "$name: $((SECONDS - t0)) s"; } | tee -a "$OUT/host_ranges.log"
  NAMES+=("$name")
}
dense() {
  train lb_h1024_l4_s512 12 "${LB1024[@]}"
  train lb_h1024_l4_s512_graphed 12 "${LB1024[@]}" --cuda-graph-impl local
  train lb_h512_l12_s256_graphed 12 "${LB512[@]}" --cuda-graph-impl local
  train llama1b_l2_s1024 12 --model llama3.2-1b --num-layers 2 --seq-length 1024 --micro-batch-size 1 \
      --global-batch-size 4
  train llama1b_s2048_gbs4 10 --model llama3.2-1b --seq-length 2048 --micro-batch-size 1 --global-batch-size 4
  train llama1b_s4096 8 --model llama3.2-1b --seq-length 4096 --micro-batch-size 1 --global-batch-size 8
  tar czf "$OUT/host_ranges.tgz" --exclude tb -C runs/out "${NAMES[@]}"
  python3 runs/bench/swiglu_kernels.py > "$OUT/swiglu_kernels.txt" 2>&1 || echo "swiglu_kernels.py failed" >> "$OUT/swiglu_kernels.txt"
  tail -n 20 "$OUT/swiglu_kernels.txt"
}
moe() {
  NAMES=()
  MOE=(--model mixtral-8x7b-2l --micro-batch-size 1 --global-batch-size 8 --moe-aux-loss-coeff 0.02)
  train mixtral-8x7b-2l 8 "${MOE[@]}"
  train mixtral-8x7b-2l_grouped 8 "${MOE[@]}" --moe-grouped-gemm
  tar czf "$OUT/host_ranges_moe.tgz" --exclude tb -C runs/out "${NAMES[@]}"
}
for part in ${PARTS:-dense}; do "$part"; done
ls -la "$OUT"
