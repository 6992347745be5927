#!/usr/bin/env bash
# engine/jit.py's fusions compiled (the default) and eager (TRAIN_LEDGER_COMPILE=0) on one H200, side by side, each
# run reconciled on the device: two shapes, the launch-bound lb_h1024_l4_s512 (12 iterations) and the dense
# llama3.2-1b at seq 4096 (8 iterations), --all-probes (the run's own compute and host sweeps), no profiler. The eager
# runs' manifests record implementation.jit_fuser_compile false and their reconciliations name it among the missing;
# the compiled runs' do not. $OUT/eager_fusions.log: each run's last lines, wall time, steps and `train-ledger
# reconcile`'s summary; $OUT/eager_fusions.tgz: the four run directories (no TensorBoard). About 6 minutes.
#     OUT=dir bash runs/bench/eager_fusions_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/eager_fusions_h200}
source runs/bench/device_setup.sh
DENSE=(--model llama3.2-1b --seq-length 4096 --micro-batch-size 1 --global-batch-size 8)
LOG="$OUT/eager_fusions.log"
NAMES=()
train() {  # train NAME COMPILE ITERS FLAGS...
  local name=$1 compile=$2 iters=$3 log="runs/out/$1.log"; shift 3
  rm -rf "runs/out/$name"
  local t0=$SECONDS
  TRAIN_LEDGER_COMPILE=$compile python3 -m cli train --nproc-per-node 1 --bf16 --use-distributed-optimizer \
    "${ADAM[@]}" --all-probes --train-iters "$iters" "$@" --run-dir "runs/out/$name" > "$log" 2>&1
  { tail -n 2 "$log"
    echo "$name (TRAIN_LEDGER_COMPILE=$compile): $((SECONDS - t0)) s"
    step_summary "$log"
    python3 -m cli reconcile "runs/out/$name" 2>&1 | grep -v "^  \[" ; } | tee -a "$LOG"
  NAMES+=("$name")
}
train lb_h1024_l4_s512_compiled 1 12 "${LB1024[@]}"
train lb_h1024_l4_s512_eager 0 12 "${LB1024[@]}"
train llama1b_s4096_compiled 1 8 "${DENSE[@]}"
train llama1b_s4096_eager 0 8 "${DENSE[@]}"
tar czf "$OUT/eager_fusions.tgz" --exclude tb -C runs/out "${NAMES[@]}"
ls -la "$OUT"
