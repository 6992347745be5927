#!/usr/bin/env bash
# CUPTI left attached after a profiler window, on one H200: runs/bench/cupti_teardown.py on the demo's one-GPU run
# (one round) and on the launch-bound shape (two rounds), its output in $OUT/cupti_teardown_{demo,lb}.txt and the run
# directories (no TensorBoard, no traces) in $OUT/cupti_teardown.tgz, the demo's detached run with its trace in
# $OUT/cupti_teardown_demo_traced.tgz. About 7 minutes.
#     OUT=dir [LB_REPEATS=2] bash runs/bench/cupti_teardown_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/cupti_teardown_h200}
source runs/bench/device_setup.sh
R=runs/out/cupti_teardown
python3 runs/bench/cupti_teardown.py --shape demo --train-iters 12 --repeats 1 --out $R 2>&1 \
  | grep -v "UserWarning\|return Variable._execution\|_warn_once" | tee "$OUT/cupti_teardown_demo.txt"
python3 runs/bench/cupti_teardown.py --shape launch-bound --train-iters 16 --repeats ${LB_REPEATS:-2} --out $R 2>&1 \
  | grep -v "UserWarning\|return Variable._execution\|_warn_once" | tee "$OUT/cupti_teardown_lb.txt"
tar czf "$OUT/cupti_teardown.tgz" --exclude tb --exclude traces -C runs/out cupti_teardown
tar czf "$OUT/cupti_teardown_demo_traced.tgz" --exclude tb -C $R demo_detached__round_1_
ls -la "$OUT"
