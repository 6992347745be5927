#!/usr/bin/env bash
# Our engine beside torchtitan 0.3.0 and megatron-core on one H200 (BENCHMARKS.md, "torchtitan"), then the FP8 pair's
# run-to-run noise (PARTS, in this order; each runs even if an earlier one failed):
#   titan   runs/bench/vs_megatron.py at seq 4096, 8 micro-batches: torchtitan (runs/bench/anchors/torchtitan_anchor.py),
#           ours and megatron-core, one round each
#   seeds   runs/bench/fp8.py --seed 1235 --no-layer: the bf16 and fp8 runs again with another seed (initialisation
#           and data order), so the fp8 - bf16 loss gap can be held against two bf16 runs' gap
# Needs the wheels of ../.whl: torchtitan 0.3.0 and its pure-Python dependencies, megatron-core, torchao, nvtx, pynvml,
# msgspec (runs/bench/anchors/README.md).
#     OUT=dir [PARTS="titan seeds"] bash runs/bench/torchtitan_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/torchtitan_h200}
PARTS=${PARTS:-titan seeds}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch; print(torch.__version__)"; lscpu | grep -E "Model name|^CPU\(s\)"; } > "$OUT/device.txt" 2>&1

titan() {
  python3 runs/bench/vs_megatron.py --seq 4096 --microbatches 8 --rounds 1 --variants torchtitan ours mcore \
      --steps 12 --timed 8 --out "$OUT/vs_torchtitan.json" > "$OUT/vs_torchtitan.log" 2>&1
  echo "vs_megatron exit $?"; tail -n 12 "$OUT/vs_torchtitan.log"
}
seeds() {
  python3 runs/bench/fp8.py --out /tmp/fp8_seed --iters 50 --seed 1235 --no-layer > "$OUT/fp8_seed.log" 2>&1
  echo "fp8.py exit $?"; cp /tmp/fp8_seed/fp8.json "$OUT/fp8_seed.json" 2>/dev/null
  grep -E "tokens/s:|mean of the last" "$OUT/fp8_seed.log"
}
for part in $PARTS; do "$part"; done
