#!/usr/bin/env bash
# The host's pace with the training process pinned to cores or not, on one H200 (runs/bench/host_pinning.py): the
# launch-bound and the 2-layer shapes, three interleaved rounds each; then the graphed layers' capture with autograd's
# stream-mismatch warning made an error. Results in $OUT/host_pinning.txt, the logs in $OUT/logs.tgz.
#     OUT=dir bash runs/bench/host_pinning_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/host_pinning_h200}
source runs/bench/device_setup.sh
{ nproc; lscpu | grep -E "^(Thread|Core|Socket|NUMA node\(s\)|Hypervisor)"; } >> "$OUT/device.txt"
for shape in lb l2; do
  python3 runs/bench/host_pinning.py --shape "$shape" --cores "${CORES:-2-5}" --repeats "${REPEATS:-3}" \
    --out /tmp/host_pinning >> "$OUT/host_pinning.txt" 2>&1
done
mkdir -p /tmp/pin_logs
LB="--bf16 --use-distributed-optimizer --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 1 --weight-decay 0.1 --clip-grad 1.0
 --mock-data --model llama3.2-1b --num-layers 4 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16
 --num-query-groups 4 --seq-length 512 --max-position-embeddings 512 --micro-batch-size 2 --global-batch-size 8"
# shellcheck disable=SC2086
PYTHONWARNINGS="error:The AccumulateGrad:UserWarning" python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
  -m engine.train $LB --cuda-graph-impl local --all-probes --train-iters 6 --run-dir /tmp/pin_graphed \
  > /tmp/pin_logs/graphed_warning.log 2>&1
echo "graphed, the stream warning an error: exit $?; AccumulateGrad lines: $(grep -c AccumulateGrad /tmp/pin_logs/graphed_warning.log)" \
  >> "$OUT/host_pinning.txt"
tar czf "$OUT/logs.tgz" -C /tmp pin_logs
cat "$OUT/host_pinning.txt"
