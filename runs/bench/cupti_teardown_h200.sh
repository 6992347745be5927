#!/usr/bin/env bash
# CUPTI left attached after a profiler window, on one H200: runs/bench/cupti_teardown.py (the demo's one-GPU run with
# TEARDOWN_CUPTI=0, with the default now, without a window, and graphed), its output in $OUT/cupti_teardown.txt and
# the run directories (no TensorBoard, no traces) in $OUT/cupti_teardown.tgz, the first detached run's with its trace in
# $OUT/cupti_teardown_detached_traced.tgz. About 6 minutes.
#     OUT=dir bash runs/bench/cupti_teardown_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/cupti_teardown_h200}
source runs/bench/device_setup.sh
python3 runs/bench/cupti_teardown.py --train-iters 12 --repeats 2 --out runs/out/cupti_teardown 2>&1 | tee "$OUT/cupti_teardown.txt"
tar czf "$OUT/cupti_teardown.tgz" --exclude tb --exclude traces -C runs/out cupti_teardown
tar czf "$OUT/cupti_teardown_detached_traced.tgz" --exclude tb -C runs/out/cupti_teardown detached__round_1_
ls -la "$OUT"
