#!/usr/bin/env bash
# FP8 against bf16 on one H200 (BENCHMARKS.md, "FP8"), in parts (PARTS, in this order; each runs even if an earlier
# one failed):
#   pair    runs/bench/fp8.py at its defaults (llama3.1-8b cut to 4 layers, seq 8192, 4 micro-batches of 1, 50 steps
#           each, every probe on): bf16 and fp8, and one layer's saved set; run directories into $OUT/runs.tgz
#   output  the same pair with --fp8-output-layer on the fp8 run (no layer measurement), then that fp8 run again with
#           --seed 1235 (its bf16 twin is the "seeds" part of runs/bench/torchtitan_h200.sh)
# Needs the wheels of ../.whl: torchao 0.18.0, nvtx, pynvml, msgspec (HolisticTraceAnalysis, psutil and pyyaml for
# the ledger's HTA cross-check).
#     OUT=dir [ITERS=50] [PARTS="pair output"] bash runs/bench/fp8_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/fp8_h200}
PARTS=${PARTS:-pair}
source runs/bench/device_setup.sh
python3 -c "import torchao; print('torchao', torchao.__version__)" >> "$OUT/device.txt" 2>&1

pair() {
  python3 runs/bench/fp8.py --out /tmp/fp8_work --iters "${ITERS:-50}" > "$OUT/fp8.log" 2>&1
  echo "fp8.py exit $?"
  cp /tmp/fp8_work/fp8.json /tmp/fp8_work/runs.tgz "$OUT/" 2>/dev/null
  tail -n 80 "$OUT/fp8.log"
}
output() {
  python3 runs/bench/fp8.py --out /tmp/fp8_output --iters "${ITERS:-50}" --output-layer --no-layer \
      > "$OUT/fp8_output.log" 2>&1
  echo "fp8.py --output-layer exit $?"; cp /tmp/fp8_output/fp8.json "$OUT/fp8_output.json" 2>/dev/null
  python3 runs/bench/fp8.py --out /tmp/fp8_output_seed --iters "${ITERS:-50}" --output-layer --no-layer --runs fp8 \
      --seed 1235 > "$OUT/fp8_output_seed.log" 2>&1
  echo "fp8.py --output-layer --seed 1235 exit $?"; cp /tmp/fp8_output_seed/fp8.json "$OUT/fp8_output_seed.json"
  grep -E "tokens/s:|mean of the last|tokens_per_s |step time|peak_allocated" "$OUT/fp8_output.log" \
      "$OUT/fp8_output_seed.log"
}
for part in $PARTS; do "$part"; done
