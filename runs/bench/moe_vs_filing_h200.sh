#!/usr/bin/env bash
# Issue Engine VII's MoE goal side by side in one call: mixtral-8x7b-2l (seq 4096, micro-batch 1, 8 micro-batches,
# bf16, aux loss 0.02, --timers, $ITERS steps, default 12) on the engine that ran it at 492 ms a step when the issue
# was filed (commit 10e5f52, extracted into .bench/engine_at_filing by `git archive 10e5f52 cli common engine ledger
# probes`) and on this checkout's engine, default (SequentialMLP) and fastest (--moe-grouped-gemm
# --moe-delay-expert-wgrad), alternated $ROUNDS times (default 2). Each run's log goes to $OUT; the summary prints
# each run's steps 2-N (min, median, max).
#     OUT=dir [ROUNDS=2] [ITERS=12] bash runs/bench/moe_vs_filing_h200.sh   (carry .whl and .bench)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/moe_vs_filing_h200}
source runs/bench/device_setup.sh
ARGS=(--model mixtral-8x7b-2l --bf16 --micro-batch-size 1 --global-batch-size 8 --moe-aux-loss-coeff 0.02 --timers
      --train-iters "${ITERS:-12}")

run() {  # $1: name, $2: the engine's directory, then the variant's flags
  local name=$1 root=$2 log="$OUT/$1_r$round.log" dir="/tmp/moe_vs_filing/$1_r$round"
  shift 2
  rm -rf "$dir"  # a warm machine keeps the last call's
  (cd "$root" && PYTHONPATH="/tmp/site:$root" python3 -m torch.distributed.run --standalone --nproc-per-node 1 \
    -m engine.train "${ARGS[@]}" "$@" --run-dir "$dir" > "$log" 2>&1)
  echo "$name round $round exit $?"
  step_summary "$log"
}
for round in $(seq 1 "${ROUNDS:-2}"); do
  run at_filing "$PWD/.bench/engine_at_filing"
  run grouped_delayed "$PWD" --moe-grouped-gemm --moe-delay-expert-wgrad
  run sequential "$PWD"
done
