#!/bin/bash
# train-ledger / runs/megatron/lm_tensorboard_run.sh -- a run directory written by Megatron-LM itself, no wrapper file
#
# Runs real Megatron-LM (pretrain_gpt.py of Megatron Core 0.18.2) on one GPU: mock data, a 2-layer GQA + SwiGLU +
# RMSNorm + RoPE model (hidden 256, seq 512, local transformer implementation: no Apex, no Transformer Engine),
# 12 iterations, with --tensorboard-dir, --log-memory-to-tensorboard, --log-timers-to-tensorboard and --profile
# --use-pytorch-profiler over iterations 5-7. What Megatron-LM writes is the run directory, as it is:
#   RUN/tensorboard/events.out.tfevents.*   every argument as a text summary, mem-* / iteration-time / loss scalars
#   RUN/torch_profile/rank-0.json.gz        the profiler's trace (Megatron writes it to --tensorboard-dir/../torch_profile)
#   RUN/logs/torchrun.log, provenance.txt   the console output; machine, versions and how the helper was built
# packed into $OUT/megatron_lm_run.tgz (the folder megatron_lm_1gpu/). Then, on that copy, `train-ledger reconcile`
# (its output kept out of the run directory, in $OUT/ledger_check/) as a first look.
#
# Offline: the Megatron-LM source (megatron/, pretrain_gpt.py, gpt_builders.py, model_provider.py, LICENSE and
# MEGATRON_SHA of the tag, prebuilt/) is carried in MEGATRON_LM (default .mlm), the wheels Megatron needs beyond
# torch, numpy and tensorboard in WHEELS (default .whl: PyYAML, pybind11, einops); runs/megatron/lm_setup.sh makes
# it runnable (wheels, the dataset helper, triton) and logs each step. runs/megatron/lm_h200_cases.sh runs the
# larger cases (Llama-3.2-1B widths, local and flash attention, Megatron's timers).
#
# usage (from the repository root): OUT=DIR runs/megatron/lm_tensorboard_run.sh
#        CHECK_ONLY=1 prepares everything (wheels, helper, launcher) and stops before training (no GPU needed).
set -euo pipefail

REPO="$(pwd)"
MLM_SRC="$(realpath "${MEGATRON_LM:-.mlm}")"
WHEELS="$(realpath "${WHEELS:-.whl}")"
OUT="$(realpath -m "${OUT:?set OUT to the folder that receives megatron_lm_run.tgz}")"
WORK="${WORK:-/tmp/megatron_lm}"
PY="${PYTHON:-python3}"
NAME=megatron_lm_1gpu
RUN="$WORK/$NAME"
PROVENANCE="$RUN/logs/provenance.txt"
# shellcheck source=runs/megatron/lm_setup.sh
source "$REPO/runs/megatron/lm_setup.sh"
mkdir -p "$OUT" "$RUN/logs"

ARGS=(
  --num-layers 2 --hidden-size 256 --ffn-hidden-size 1024
  --num-attention-heads 4 --group-query-attention --num-query-groups 2
  --seq-length 512 --max-position-embeddings 512 --position-embedding-type rope --rotary-base 10000
  --swiglu --normalization RMSNorm --disable-bias-linear --untie-embeddings-and-output-weights
  --attention-dropout 0.0 --hidden-dropout 0.0
  --transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion --no-masked-softmax-fusion
  --no-bias-swiglu-fusion --no-rope-fusion
  --micro-batch-size 2 --global-batch-size 8 --use-distributed-optimizer
  --bf16 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2 --train-iters 12
  --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
  --mock-data --tokenizer-type NullTokenizer --vocab-size 8000 --split 99,1,0
  --log-interval 1 --log-memory-to-tensorboard --log-timers-to-tensorboard --log-throughput
  --tensorboard-dir "$RUN/tensorboard"
  --profile --use-pytorch-profiler --profile-step-start 5 --profile-step-end 8 --profile-ranks 0
  --eval-iters 0 --eval-interval 1000 --save-interval 1000000 --distributed-timeout-minutes 10
)
log "pretrain_gpt.py ${ARGS[*]}"
if [ -n "${CHECK_ONLY:-}" ]; then log "CHECK_ONLY: prepared in $WORK, not training"; exit 0; fi
"$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"' || exit 2
log "device: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo unknown)"

set +e
(cd "$MLM" && CUDA_DEVICE_MAX_CONNECTIONS=1 timeout --kill-after=20 "${TRAIN_TIMEOUT_S:-420}" \
  "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 "$ENTRY" "${ARGS[@]}") 2>&1 | tee "$RUN/logs/torchrun.log"
CODE=${PIPESTATUS[0]}
set -e
log "pretrain_gpt.py exit code $CODE$([ "$CODE" = 124 ] && echo ' (timed out)')"
find "$RUN" -type f -printf '%10s %p\n' | sed "s#$WORK/##" | tee "$OUT/files.txt"
tar -czf "$OUT/megatron_lm_run.tgz" -C "$WORK" "$NAME"
SIZE=$(stat -c %s "$OUT/megatron_lm_run.tgz")
echo "lm_tensorboard_run: $OUT/megatron_lm_run.tgz: $SIZE bytes$([ "$SIZE" -gt 5242880 ] && echo ' (over 5 MiB)')"

# a first look: the ledger on the copy (the run directory itself stays as Megatron wrote it)
cp "$RUN/logs/torchrun.log" "$OUT/"
mkdir -p "$WORK/check" && cp -r "$RUN" "$WORK/check/"
(cd "$REPO" && PYTHONPATH="$REPO:$SITE" "$PY" -m cli.main reconcile "$WORK/check/$NAME" --out "$OUT/ledger_check") \
  || echo "lm_tensorboard_run: train-ledger reconcile exited $? on the run (see above)"
exit "$CODE"
