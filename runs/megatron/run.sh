#!/bin/bash
# train-ledger / runs/megatron/run.sh -- Llama-3.2-1B shape, 8 GPUs: TP2 x PP2 x DP2, ZeRO-1 (distributed optimizer)
#
# Runs Megatron-LM's pretrain_gpt.py (the layout of docs/engine.md, "Rank groups") from a checkout you provide,
# and writes the run directory layout `train-ledger reconcile` ingests (ledger/evidence/megatron/ingest.py):
#   RUN/megatron_run.json   argv, world size, times, exit code, the checkout's path and git sha
#   RUN/tb/                 TensorBoard scalars (mem-*, iteration-time, ...) and the profiler's *.pt.trace.json
#   RUN/logs/torchrun.log   the console output
#
# usage: MEGATRON_LM=/path/to/Megatron-LM runs/megatron/run.sh [RUN_DIR]      (or: run.sh MEGATRON_PATH [RUN_DIR])
#        NPROC (default 8) sets GPUs per node; extra Megatron flags may follow in MEGATRON_EXTRA_ARGS.
# then:  train-ledger reconcile RUN_DIR && train-ledger report RUN_DIR
#
# Beyond the reference run's flags (docs/engine.md, "The reference run"), each because the ledger needs it:
# --profile (Megatron only starts the torch profiler with it), --log-timers-to-tensorboard (iteration-time),
# --log-throughput, and every output under RUN_DIR.
set -euo pipefail

if [ $# -ge 1 ] && [ -f "$1/pretrain_gpt.py" ]; then MEGATRON_LM="$1"; shift; fi
MEGATRON_LM="${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (the folder holding pretrain_gpt.py)}"
[ -f "$MEGATRON_LM/pretrain_gpt.py" ] || { echo "run.sh: $MEGATRON_LM/pretrain_gpt.py not found" >&2; exit 2; }
RUN_DIR="$(realpath -m "${1:-runs/out/megatron-$(date -u +%Y%m%dT%H%M%SZ)}")"
NPROC="${NPROC:-8}"
if [ -e "$RUN_DIR/megatron_run.json" ]; then echo "run.sh: $RUN_DIR already holds a run" >&2; exit 2; fi
mkdir -p "$RUN_DIR/tb" "$RUN_DIR/logs"

ARGS=(
  --use-mcore-models --transformer-impl transformer_engine
  --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192
  --num-attention-heads 32 --group-query-attention --num-query-groups 8
  --seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope --rotary-base 500000
  --swiglu --normalization RMSNorm --disable-bias-linear --untie-embeddings-and-output-weights
  --attention-dropout 0.0 --hidden-dropout 0.0
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
  --micro-batch-size 1 --global-batch-size 16
  --bf16 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 10 --train-iters 50
  --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
  --mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --split 99,1,0
  --log-interval 1 --log-memory-to-tensorboard --log-timers-to-tensorboard --log-throughput
  --tensorboard-dir "$RUN_DIR/tb"
  --profile --use-pytorch-profiler --profile-step-start 20 --profile-step-end 22 --profile-ranks 0 1 2 3 4 5 6 7
  --eval-iters 0 --save-interval 1000000
  --distributed-timeout-minutes 30
)
# shellcheck disable=SC2206
EXTRA=(${MEGATRON_EXTRA_ARGS:-})
ARGS+=("${EXTRA[@]}")

write_meta() {  # write_meta ENDED EXIT_CODE -- atomically, so a reader never sees half a file
  python3 - "$RUN_DIR" "$NPROC" "$MEGATRON_LM" "$STARTED" "$1" "$2" "${ARGS[@]}" <<'PY'
import json, os, subprocess, sys
run, nproc, path, started, ended, code, *argv = sys.argv[1:]
sha = subprocess.run(["git", "-C", path, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
meta = {"framework": "megatron-lm", "run_id": os.path.basename(run), "argv": argv,
        "world_size": int(nproc) * int(os.environ.get("NNODES", "1")), "megatron_path": path,
        "megatron_git_sha": sha or None, "started": started, "ended": ended or None,
        "exit_code": int(code) if code else None}
tmp = os.path.join(run, ".megatron_run.json.tmp")
with open(tmp, "w") as f:
    json.dump(meta, f, indent=2)
os.replace(tmp, os.path.join(run, "megatron_run.json"))
PY
}

STARTED="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
write_meta "" ""
set +e
( cd "$MEGATRON_LM" && torchrun --nproc_per_node "$NPROC" pretrain_gpt.py "${ARGS[@]}" ) 2>&1 | tee "$RUN_DIR/logs/torchrun.log"
CODE=${PIPESTATUS[0]}
set -e
write_meta "$(date -u +%Y-%m-%dT%H:%M:%SZ)" "$CODE"
echo "run directory: $RUN_DIR (exit code $CODE); next: train-ledger reconcile $RUN_DIR"
exit "$CODE"
