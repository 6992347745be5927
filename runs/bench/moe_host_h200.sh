#!/usr/bin/env bash
# The MoE step's host stalls at new expert row counts (BENCHMARKS.md, 2026-12-03), on one H200. PARTS, in order:
#   shapes  runs/bench/gemm_shape_host.py: torch.mm's host time at expert row counts new to the process, seen, and rounded
#           up to a multiple, with CUDA's lazy module loading (the default) and with CUDA_MODULE_LOADING=EAGER
#   moe     mixtral-8x7b-2l (seq 4096, micro-batch 1, 8 micro-batches, --all-probes), $ITERS steps (default 16), one run
#           per --moe-pad-expert-rows value in $PADS (default "none 64 128"; none: no padding; grouped: none and
#           --moe-grouped-gemm; a value may repeat, to alternate; a value ending in +delay adds
#           --moe-delay-expert-wgrad), one after another, the n-th in
#           /tmp/moe_pad_<value>_<n>; each run's step times and median; PROFILE=1 adds the PyTorch profiler over step
#           ITERS-1 (its trace goes into the run's tar)
# PARTS must not be empty (an empty PARTS means the default).
#     OUT=dir [PARTS="shapes moe"] [ITERS=16] [PADS="none 64"] [PROFILE=1] bash runs/bench/moe_host_h200.sh
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
moe_run() {  # $1: none | grouped | a multiple, either with +delay, $2: the run's place in PADS
  local extra=() pad=${1%+delay}
  case "$pad" in none) ;; grouped) extra=(--moe-grouped-gemm) ;; *) extra=(--moe-pad-expert-rows "$pad") ;; esac
  [ "$pad" != "$1" ] && extra+=(--moe-delay-expert-wgrad)
  local last=$((${ITERS:-16} - 1))
  [ -n "${PROFILE:-}" ] && extra+=(--use-pytorch-profiler --profile-step-start "$last" --profile-step-end "$last")
  rm -rf "/tmp/moe_pad_$1_$2"  # a warm machine keeps the last call's
  python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m engine.train \
    --model mixtral-8x7b-2l --bf16 --micro-batch-size 1 --global-batch-size 8 --moe-aux-loss-coeff 0.02 \
    --all-probes --train-iters "${ITERS:-16}" ${extra[@]+"${extra[@]}"} --run-dir "/tmp/moe_pad_$1_$2" > "$OUT/moe_pad_$1_$2.log" 2>&1
  echo "moe pad $1 (run $2) exit $?"
  step_summary "$OUT/moe_pad_$1_$2.log"
}
moe() {  # one tar a run (its directory and log), so that each stays under the device's per-file limit
  local n=0
  for pad in ${PADS:-none 64 128}; do
    n=$((n + 1)); moe_run "$pad" "$n"
    mv "$OUT/moe_pad_${pad}_$n.log" "/tmp/moe_pad_${pad}_$n/"
    tar czf "$OUT/moe_pad_${pad//+/_}_$n.tar.gz" --exclude tb -C /tmp "moe_pad_${pad}_$n"  # no "+": $OUT's names
  done
}
for part in $PARTS; do "$part"; done
