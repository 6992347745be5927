#!/usr/bin/env bash
# A GPU kind's hardware file measured in one device call, no training run judged (BENCHMARKS.md, 2026-12-05 seventh):
# the kernel grid (runs/bench/hardware_sweep.py: the main grid first at every model's seq 4096, then larger
# micro-batches, flash attention at seq 256-1024, an MoE layer's routing kernels, the experts' GEMMs; each part cut
# at its budget), the host sweep alone (probes/host_sweep.py, plain and profiled, with the graph primitives), memory
# outside PyTorch (runs/bench/outside_pytorch.py), and the host block's calibration run: llama3.2-1b cut to 2 layers
# at seq 1024 with --all-probes and a profiler window at steps 4-5 (the H200's was tests/fixtures/h200_2layer_profiled).
# Fit off the device: `python3 runs/bench/hardware_fit.py --gpu KIND --sweeps ... --sweeps-only --write` and
# `python3 runs/bench/host_block.py --traces RUN --graphs host_sweep.jsonl --hardware KIND --write`. About 8 minutes.
#     OUT=dir [GRID_S=180] bash runs/bench/hardware_calibration.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/hardware_calibration}
source runs/bench/device_setup.sh
lscpu > "$OUT/lscpu.txt"
mkdir -p runs/out/sweeps
sweep() {  # $1: name, $2: budget in seconds, then hardware_sweep.py's filter flags
  local name=$1 budget=$2; shift 2
  python3 runs/bench/hardware_sweep.py --out "runs/out/sweeps/$name.json.gz" --budget-s "$budget" "$@" \
    > "runs/out/sweeps/$name.log" 2>&1
  echo "$name: exit $? $(tail -n 2 "runs/out/sweeps/$name.log" | head -n 1)" | tee -a "$OUT/calibration.log"
}
sweep hardware_sweep "${GRID_S:-180}"
sweep hardware_sweep_mbs 40 --micro-batches 4 2
sweep hardware_sweep_short_attention 40 --short-attention
sweep hardware_sweep_moe 35 --moe
sweep hardware_sweep_experts 30 --experts
tar czf "$OUT/sweeps.tgz" -C runs/out sweeps
host_sweep_records "$OUT/host_sweep.jsonl" | grep "^host sweep:" | tee -a "$OUT/calibration.log"
python3 runs/bench/outside_pytorch.py --json "$OUT/outside_pytorch.json" > "$OUT/outside_pytorch.log" 2>&1
echo "outside_pytorch: exit $?" | tee -a "$OUT/calibration.log"
rm -rf runs/out/host_calibration_2layer
t0=$SECONDS
python3 -m cli train --nproc-per-node 1 --bf16 --use-distributed-optimizer "${ADAM[@]}" --all-probes \
    --model llama3.2-1b --num-layers 2 --seq-length 1024 --micro-batch-size 1 --global-batch-size 4 \
    --use-pytorch-profiler --profile-step-start 4 --profile-step-end 5 --train-iters 8 \
    --run-dir runs/out/host_calibration_2layer > runs/out/host_calibration_2layer.log 2>&1
echo "host_calibration_2layer: exit $? in $((SECONDS - t0)) s" | tee -a "$OUT/calibration.log"
step_summary runs/out/host_calibration_2layer.log | tee -a "$OUT/calibration.log"
mv runs/out/host_calibration_2layer.log runs/out/host_calibration_2layer/train.log
tar czf "$OUT/host_calibration_2layer.tgz" --exclude tb -C runs/out host_calibration_2layer
ls -la "$OUT"
