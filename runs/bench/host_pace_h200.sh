#!/usr/bin/env bash
# Why a host-bound step issues its passes slower than the host sweep's isolated pass (BENCHMARKS.md, 2026-12-03
# sixth): two compiled launch-bound shapes, each run four ways one after another on one H200, no profiler, the timers'
# host times giving each range's issue:
#   timers   --timers --host-sweep (the sweep's pass.forward / pass.backward beside the step's ranges)
#   nvtx     the same with --nvtx (the engine's NVTX ranges, which --all-probes turns on)
#   nogc     the same as timers with Python's cyclic garbage collector off in every process (a sitecustomize that
#            calls gc.disable(), put first on PYTHONPATH)
#   all      --all-probes, as the fixtures of tests/fixtures/h200_host_ranges
# The run directories (no TensorBoard) in $OUT/host_pace.tgz, the runs' last lines in $OUT/host_pace.log.
#     OUT=dir bash runs/bench/host_pace_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/host_pace_h200}
source runs/bench/device_setup.sh
mkdir -p /tmp/nogc && echo "import gc; gc.disable()" > /tmp/nogc/sitecustomize.py
L2=(--model llama3.2-1b --num-layers 2 --seq-length 1024 --micro-batch-size 1 --global-batch-size 4)
NAMES=()
train() {
  local name=$1; shift
  rm -rf "runs/out/$name"
  local t0=$SECONDS
  { python3 -m cli train --nproc-per-node 1 --bf16 --use-distributed-optimizer "${ADAM[@]}" --train-iters 12 "$@" \
      --run-dir "runs/out/$name" 2>&1 | tail -n 1
    echo "$name: $((SECONDS - t0)) s"; } | tee -a "$OUT/host_pace.log"
  NAMES+=("$name")
}
for shape in lb L2; do
  if [ "$shape" = lb ]; then ARGS=("${LB1024[@]}"); else ARGS=("${L2[@]}"); fi
  train "${shape}_timers" "${ARGS[@]}" --timers --host-sweep
  train "${shape}_nvtx" "${ARGS[@]}" --timers --host-sweep --nvtx
  SAVED=$PYTHONPATH; export PYTHONPATH="/tmp/nogc:$PYTHONPATH"
  train "${shape}_nogc" "${ARGS[@]}" --timers --host-sweep
  export PYTHONPATH=$SAVED
  train "${shape}_all" "${ARGS[@]}" --all-probes
done
tar czf "$OUT/host_pace.tgz" --exclude tb -C runs/out "${NAMES[@]}"
ls -la "$OUT"
