#!/usr/bin/env bash
# Our engine beside torchtitan and megatron-core on one H200 (BENCHMARKS.md, "torchtitan"), and the FP8 pair's
# run-to-run noise (PARTS, in this order; each runs even if an earlier one failed):
#   smoke   runs/bench/anchors/torchtitan_anchor.py --tiny: torchtitan's debug model, four steps (does it import
#           and train on this torch?)
#   titan   runs/bench/vs_megatron.py at seq 4096, 8 micro-batches: torchtitan (runs/bench/anchors/torchtitan_anchor.py),
#           ours and megatron-core, $ROUNDS rounds (default 1) alternating
#   seeds   runs/bench/fp8.py --seed 1235 --no-layer: the bf16 and fp8 runs again with another seed (initialisation
#           and data order), so the fp8 - bf16 loss gap can be held against two bf16 runs' gap
# Needs the wheels of ../.whl: torchtitan (0.3.0 with a torch newer than 2.11, else 0.2.2) and the dependencies its
# model imports, megatron-core, torchao, nvtx, pynvml, msgspec (runs/bench/anchors/README.md). PARTS must not be
# empty (an empty PARTS means the default).
#     OUT=dir [PARTS="smoke titan"] [ROUNDS=2] bash runs/bench/torchtitan_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/torchtitan_h200}
PARTS=${PARTS:-smoke titan}
source runs/bench/device_setup.sh

smoke() {
  python3 runs/bench/anchors/torchtitan_anchor.py --tiny --seq 256 --steps 4 --timed 2 > "$OUT/titan_smoke.log" 2>&1
  echo "torchtitan smoke exit $?"; tail -n 5 "$OUT/titan_smoke.log" | cut -c1-400
}
titan() {
  python3 runs/bench/vs_megatron.py --seq 4096 --microbatches 8 --rounds "${ROUNDS:-1}" --variants torchtitan ours mcore \
      --steps 12 --timed 8 --out "$OUT/vs_torchtitan.json" > "$OUT/vs_torchtitan.log" 2>&1
  echo "vs_megatron exit $?"; tail -n 12 "$OUT/vs_torchtitan.log"
}
seeds() {
  python3 runs/bench/fp8.py --out /tmp/fp8_seed --iters 50 --seed 1235 --no-layer > "$OUT/fp8_seed.log" 2>&1
  echo "fp8.py exit $?"; cp /tmp/fp8_seed/fp8.json "$OUT/fp8_seed.json" 2>/dev/null
  grep -E "tokens/s:|mean of the last" "$OUT/fp8_seed.log"
}
for part in $PARTS; do "$part"; done
