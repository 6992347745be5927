#!/usr/bin/env bash
# Shapes no committed run has had (runs/bench/new_shapes.py), trained one after the other on one H200 with
# --all-probes, ITERS steps each (default 10): each run directory (no TensorBoard) with its log in $OUT/<name>.tgz, a
# line a run in $OUT/new_shapes.log. NAMES: a subset, in order (default: every shape). Judge them on the CPU with
# `train-ledger simulate --validate DIR ...` against the predictions `python3 runs/bench/new_shapes.py --predict`
# printed before the call. SET: the set of shapes (new_shapes.py --set; default the first, 2026-12-04). EXTRA: flags
# added to every run (a profiler window: its steps are left out of the steady ones the runs are judged on).
#     OUT=dir [SET=power] [NAMES="lb_h1024_l8_s1024_mbs4 ..."] [ITERS=10] [EXTRA="..."] bash runs/bench/new_shapes_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/new_shapes_h200}
source runs/bench/device_setup.sh
SET=${SET:-2026-12-04}
for name in ${NAMES:-$(python3 runs/bench/new_shapes.py --set "$SET" --names)}; do
  read -r -a flags < <(python3 runs/bench/new_shapes.py --set "$SET" --flags "$name") || continue
  rm -rf "runs/out/$name"  # a warm machine keeps the last call's
  t0=$SECONDS
  python3 -m cli train --nproc-per-node 1 "${flags[@]}" ${EXTRA:-} --train-iters "${ITERS:-10}" --run-dir "runs/out/$name" \
    > "runs/out/$name.log" 2>&1
  echo "$name: exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/new_shapes.log"
  step_summary "runs/out/$name.log" | tee -a "$OUT/new_shapes.log"
  mv "runs/out/$name.log" "runs/out/$name/train.log"
  tar czf "$OUT/$name.tgz" --exclude tb -C runs/out "$name"
done
