#!/usr/bin/env bash
# Where a step's allocator peak falls, on one H200: the shapes of tests/fixtures/h200_host_ranges/llama1b_l2_s1024
# (2 layers at seq 1024, where the output layer's backward was thought to set the peak) and of
# tests/fixtures/h200_moe/delayed_wgrad/pad16_delayed and h200_moe/grouped/in_place_delayed (MoE with each expert's
# weight gradients held to the step's end), each with --record-memory-history and no sweeps, and
# runs/bench/peak_moment.py over each snapshot. Then autograd's AccumulateGrad stream-mismatch warning made an error,
# with the host sweep (--all-probes) and with --cuda-graph-impl local, on the launch-bound shape.
#     OUT=dir bash runs/bench/peak_moment_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/peak_moment_h200}
source runs/bench/device_setup.sh
COMMON="--bf16 --use-distributed-optimizer --lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 1 --weight-decay 0.1 --clip-grad 1.0"
L2="$COMMON --model llama3.2-1b --num-layers 2 --seq-length 1024 --micro-batch-size 1 --global-batch-size 4"
MOE="--model mixtral-8x7b-2l --bf16 --micro-batch-size 1 --global-batch-size 8 --moe-aux-loss-coeff 0.02"
LB="$COMMON --model llama3.2-1b --num-layers 4 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16
 --num-query-groups 4 --seq-length 512 --max-position-embeddings 512 --micro-batch-size 2 --global-batch-size 8"
mkdir -p /tmp/peak_logs
train() {  # $1 name, the rest: flags
  local name=$1; shift
  rm -rf "runs/out/$name"
  # shellcheck disable=SC2068  # the flags split on spaces
  python3 -m torch.distributed.run --standalone --nproc-per-node 1 -m engine.train $@ --run-dir "runs/out/$name" \
    > "/tmp/peak_logs/$name.log" 2>&1
  echo "$name exit $?" | tee -a "$OUT/peak_moments.txt"
}
for run in "l2 $L2 --train-iters 4" "moe_pad16_delayed $MOE --moe-pad-expert-rows 16 --moe-delay-expert-wgrad --train-iters 3" \
           "moe_grouped_delayed $MOE --moe-grouped-gemm --moe-delay-expert-wgrad --train-iters 3"; do
  # shellcheck disable=SC2086
  train $run --record-memory-history
  name=${run%% *}
  python3 runs/bench/peak_moment.py "runs/out/$name" --top 30 >> "$OUT/peak_moments.txt" 2>&1
done
gzip -c runs/out/l2/memory/rank0.snapshot.pickle > "$OUT/l2_rank0.snapshot.pickle.gz"
tar czf "$OUT/runs.tgz" --exclude memory --exclude tb -C runs/out l2 moe_pad16_delayed moe_grouped_delayed
export PYTHONWARNINGS="error:The AccumulateGrad:UserWarning"
# shellcheck disable=SC2086
train warn_host_sweep $LB --all-probes --train-iters 3
# shellcheck disable=SC2086
train warn_graphed $LB --cuda-graph-impl local --train-iters 3
grep -h -B2 -A2 "AccumulateGrad" /tmp/peak_logs/warn_*.log | tail -20 > "$OUT/stream_warning.txt"
echo "stream warning lines: $(wc -l < "$OUT/stream_warning.txt")"
tar czf "$OUT/logs.tgz" -C /tmp peak_logs
