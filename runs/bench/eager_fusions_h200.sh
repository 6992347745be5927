#!/usr/bin/env bash
# engine/jit.py's fusions compiled (the default) and eager (TRAIN_LEDGER_COMPILE=0) on one H200, side by side, each
# run reconciled on the device: two shapes, the launch-bound lb_h1024_l4_s512 (12 iterations) and the dense
# llama3.2-1b at seq 4096 (8 iterations), --all-probes (the run's own compute and host sweeps), no profiler. The eager
# runs' manifests record implementation.jit_fuser_compile false and their reconciliations name it among the missing;
# the compiled runs' do not. $OUT/eager_fusions.log: each run's last lines, wall time and `train-ledger reconcile`'s
# summary; $OUT/eager_fusions.tgz: the four run directories (no TensorBoard). About 6 minutes.
#     OUT=dir bash runs/bench/eager_fusions_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/eager_fusions_h200}
source runs/bench/device_setup.sh
DENSE=(--model llama3.2-1b --seq-length 4096 --micro-batch-size 1 --global-batch-size 8)
LOG="$OUT/eager_fusions.log"
NAMES=()
train() {  # train NAME COMPILE ITERS FLAGS...
  local name=$1 compile=$2 iters=$3; shift 3
  rm -rf "runs/out/$name"
  local t0=$SECONDS
  { TRAIN_LEDGER_COMPILE=$compile python3 -m cli train --nproc-per-node 1 --bf16 --use-distributed-optimizer \
      "${ADAM[@]}" --all-probes --train-iters "$iters" "$@" --run-dir "runs/out/$name" 2>&1 | tail -n 2
    echo "$name (TRAIN_LEDGER_COMPILE=$compile): $((SECONDS - t0)) s"
    step_summary_of "runs/out/$name"
    python3 -m cli reconcile "runs/out/$name" 2>&1 | grep -v "^  \[" ; } | tee -a "$LOG"
  NAMES+=("$name")
}
step_summary_of() {  # the run's step records after the first: min, median, max ms
  python3 - "$1" <<'PY'
import json, statistics, sys
from pathlib import Path
steps = [json.loads(line) for line in (Path(sys.argv[1]) / "ranks/rank0/events.jsonl").open() if '"step"' in line]
t = sorted(1e3 * s["step_time_s"] for s in steps if s.get("kind") == "step" and s.get("step", 0) > 1)
print(f"  steps 2-{len(t) + 1}: min {t[0]:.1f} median {statistics.median(t):.1f} max {t[-1]:.1f} ms")
PY
}
train lb_h1024_l4_s512_compiled 1 12 "${LB1024[@]}"
train lb_h1024_l4_s512_eager 0 12 "${LB1024[@]}"
train llama1b_s4096_compiled 1 8 "${DENSE[@]}"
train llama1b_s4096_eager 0 8 "${DENSE[@]}"
tar czf "$OUT/eager_fusions.tgz" --exclude tb -C runs/out "${NAMES[@]}"
ls -la "$OUT"
