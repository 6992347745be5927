#!/usr/bin/env bash
# The MoE layer's router and dispatch kernels on one H200, for the hardware file (BENCHMARKS.md, 2026-12-04), and
# two mixtral-8x7b-2l runs the fit never reads, to judge it. PARTS, in order:
#   sweep  runs/bench/hardware_sweep.py --moe (router top-k, moe.permute, moe.unpermute at 2,048-16,384 tokens,
#          Mixtral's layer and a fine-grained one) -> $OUT/h200_hardware_sweep_moe.json.gz, within BUDGET_S (default 300)
#   runs   mixtral-8x7b-2l (seq 4096, micro-batch 1, 8 micro-batches, aux loss 0.02, --all-probes, $ITERS steps,
#          default 12) with SequentialMLP and with --moe-grouped-gemm, one after the other, each run directory and
#          its log tarred into $OUT (moe_<variant>.tar.gz)
#     OUT=dir [PARTS="sweep runs"] [BUDGET_S=300] [ITERS=12] bash runs/bench/moe_sweep_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/moe_sweep_h200}
PARTS=${PARTS:-sweep runs}
source runs/bench/device_setup.sh

sweep() {
  python3 runs/bench/hardware_sweep.py --moe --out "$OUT/h200_hardware_sweep_moe.json.gz" --budget-s "${BUDGET_S:-300}" \
    > "$OUT/h200_hardware_sweep_moe.log" 2>&1
  echo "sweep exit $?"; tail -n 3 "$OUT/h200_hardware_sweep_moe.log"
}
run() {  # $1: sequential | grouped
  local extra=() dir="/tmp/moe_$1"
  [ "$1" = grouped ] && extra=(--moe-grouped-gemm)
  rm -rf "$dir"  # a warm machine keeps the last call's
  python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m engine.train \
    --model mixtral-8x7b-2l --bf16 --micro-batch-size 1 --global-batch-size 8 --moe-aux-loss-coeff 0.02 \
    --all-probes --train-iters "${ITERS:-12}" ${extra[@]+"${extra[@]}"} --run-dir "$dir" > "$OUT/moe_$1.log" 2>&1
  echo "moe $1 exit $?"
  step_summary "$OUT/moe_$1.log"
  mv "$OUT/moe_$1.log" "$dir/"
  tar czf "$OUT/moe_$1.tar.gz" --exclude tb -C /tmp "moe_$1"
}
runs() { run sequential; run grouped; }
for part in $PARTS; do "$part"; done
