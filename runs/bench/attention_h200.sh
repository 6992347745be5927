#!/usr/bin/env bash
# cuDNN's fused attention (--attention-backend fused) on one H200 (BENCHMARKS.md, "core attention's kernel"), in
# parts (PARTS, in this order; each runs even if an earlier one failed):
#   kernels  runs/bench/attention_backends.py: core attention alone by SDPA backend at llama3.2-1b s4096 and
#            llama3.1-8b s8192 (causal, GQA)
#   dense    runs/bench/vs_megatron.py at seq 4096, 8 micro-batches: ours, ours with --attention-backend fused and
#            megatron-core, one round, side by side
#   ledger   the dense shape with --attention-backend fused and --all-probes into $OUT/fused_run.tgz (traces left out),
#            for `train-ledger reconcile` off the device
# Needs the wheels of ../.whl (nvtx, pynvml, msgspec, megatron-core).
#     OUT=dir [PARTS="kernels dense ledger"] bash runs/bench/attention_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/attention_h200}
PARTS=${PARTS:-kernels dense ledger}
source runs/bench/device_setup.sh
python3 -c "import torch; print('cudnn', torch.backends.cudnn.version())" >> "$OUT/device.txt" 2>&1

kernels() { python3 runs/bench/attention_backends.py 2>&1 | tee "$OUT/attention_backends.log"; }
dense() {
  python3 runs/bench/vs_megatron.py --seq 4096 --microbatches 8 --rounds 1 \
      --variants ours ours-fused-attention mcore --steps 12 --timed 8 --out "$OUT/vs_fused.json" > "$OUT/vs_fused.log" 2>&1
  echo "vs_megatron exit $?"; tail -n 8 "$OUT/vs_fused.log"
}
ledger() {
  rm -rf runs/out/fused
  python3 -m cli train --nproc-per-node 1 --model llama3.2-1b --untie-embeddings-and-output-weights --seq-length 4096 \
      --bf16 --use-distributed-optimizer --micro-batch-size 1 --global-batch-size 8 --train-iters 12 --lr 3e-4 \
      --min-lr 3e-5 --lr-warmup-iters 1 --weight-decay 0.1 --clip-grad 1.0 --all-probes --attention-backend fused \
      --run-dir runs/out/fused 2>&1 | tail -n 3
  tar czf "$OUT/fused_run.tgz" -C runs/out --exclude traces fused
}
for part in $PARTS; do "$part"; done
