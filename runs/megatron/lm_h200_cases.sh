#!/bin/bash
# train-ledger / runs/megatron/lm_h200_cases.sh -- real Megatron-LM runs on one H200 as fixtures: Llama-3.2-1B widths
# at seq 4096, Megatron's own run directories, each tarred under $OUT
#
# Runs Megatron-LM's pretrain_gpt.py (Megatron Core 0.18.2, commit 571370c, from its carried source tree: no
# Transformer Engine, no Apex) on one GPU, mock data, hidden 2048, FFN 8192, 32 heads in 8 query groups, vocabulary
# 128256 (untied), RoPE 500000, bf16, the distributed optimizer, global batch 8, 12 iterations, with every record the
# ledger reads: --log-memory-to-tensorboard, --log-timers-to-tensorboard --timing-log-level 2 (forward-backward,
# forward / backward compute, grads reduce-scatter, params all-gather, optimizer and its parts, as "<name>-time"
# scalars), --log-throughput, and the torch profiler over iterations 5-7 (torch_profile/rank-0.json.gz). Cases:
#   megatron_local_l2_mbs1    --transformer-impl local: DotProductAttention (unfused, the s x s scores kept), 2 layers
#   megatron_local_l2_mbs2    the same at micro-batch 2 (the shape whose peak the flash-attention formula missed by 51%)
#   megatron_sdpa_l4_mbs1     Megatron's local layer with flash attention through torch's SDPA (runs/megatron/
#                             megatron_sdpa_spec.py, Megatron's --spec), 4 layers, SwiGLU fused
#   megatron_sdpa_l4_mbs2     the same at micro-batch 2
#   megatron_*_level0         (named only) a case again at --timing-log-level 0: no per-pass timers, so no device
#                             synchronisation at each forward's and backward's start and end
#   megatron_local_l2_mbs2_snapshot   (SNAPSHOT=1, the default) 3 iterations of the second case with
#                             --record-memory-history: Megatron's pickled torch.cuda.memory snapshot of the last
#                             iteration (a plain-types pickle; read only with a restricted unpickler)
# Each case's run directory (tensorboard/, torch_profile/, logs/torchrun.log, logs/provenance.txt) becomes
# $OUT/<case>.tgz (without the memory snapshot if the archive would pass 15 MB); $OUT/summary.txt holds each case's
# exit code and wall time and then, while time is left (RECONCILE_DEADLINE_S, default 450), `train-ledger reconcile
# --hardware H200`'s summary of each (on a copy). A case starts only while DEADLINE_S (default 420) seconds have not
# passed since the script began; each is limited to CASE_TIMEOUT_S (default 110).
#
# Offline: the Megatron-LM source in MEGATRON_LM (default .mlm), the wheels in WHEELS (default .whl); lm_setup.sh
# makes them runnable. usage (from the repository root): OUT=DIR runs/megatron/lm_h200_cases.sh [CASE ...]
#        CHECK_ONLY=1: everything but training, on any machine: the setup, and Megatron's own parse_args and
#        validate_args on each case's flags (runs/megatron/megatron_cpu_memory.py --parse-only).
set -euo pipefail

REPO="$(pwd)"
MLM_SRC="$(realpath "${MEGATRON_LM:-.mlm}")"
WHEELS="$(realpath "${WHEELS:-.whl}")"
OUT="$(realpath -m "${OUT:?set OUT to the folder that receives the run directories}")"
WORK="${WORK:-/tmp/megatron_lm_cases}"
PY="${PYTHON:-python3}"
PROVENANCE="$WORK/provenance.txt"
STARTED=$SECONDS
# shellcheck source=runs/megatron/lm_setup.sh
source "$REPO/runs/megatron/lm_setup.sh"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: >"$SUMMARY"

COMMON=(
  --hidden-size 2048 --ffn-hidden-size 8192 --num-attention-heads 32 --group-query-attention --num-query-groups 8
  --seq-length 4096 --max-position-embeddings 4096 --position-embedding-type rope --rotary-base 500000
  --swiglu --normalization RMSNorm --disable-bias-linear --untie-embeddings-and-output-weights
  --attention-dropout 0.0 --hidden-dropout 0.0
  --transformer-impl local --no-persist-layer-norm --no-gradient-accumulation-fusion --no-masked-softmax-fusion
  --no-rope-fusion
  --global-batch-size 8 --use-distributed-optimizer --bf16
  --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 2
  --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95
  --mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --split 99,1,0
  --log-memory-to-tensorboard --log-throughput
  --eval-iters 0 --eval-interval 1000 --save-interval 1000000 --distributed-timeout-minutes 10
)
TIMED=(--train-iters 12 --log-interval 1 --log-timers-to-tensorboard --timing-log-level 2
       --profile --use-pytorch-profiler --profile-step-start 5 --profile-step-end 8 --profile-ranks 0)
# --timing-log-level 0: no per-pass timers, so no device synchronisation at each pass's start and end (level 2's
# forward-compute / backward-compute timers call torch.cuda.synchronize() in start() and stop())
LEVEL0=(--train-iters 12 --log-interval 1 --log-timers-to-tensorboard --timing-log-level 0
        --profile --use-pytorch-profiler --profile-step-start 5 --profile-step-end 8 --profile-ranks 0)
SDPA=(--spec megatron_sdpa_spec layer_spec)

case_args() {  # case_args CASE RUN: the case's flags beyond COMMON
  case "$1" in
    megatron_local_l2_mbs1) echo --num-layers 2 --micro-batch-size 1 --no-bias-swiglu-fusion "${TIMED[@]}" ;;
    megatron_local_l2_mbs2) echo --num-layers 2 --micro-batch-size 2 --no-bias-swiglu-fusion "${TIMED[@]}" ;;
    megatron_sdpa_l4_mbs1) echo --num-layers 4 --micro-batch-size 1 "${SDPA[@]}" "${TIMED[@]}" ;;
    megatron_sdpa_l4_mbs2) echo --num-layers 4 --micro-batch-size 2 "${SDPA[@]}" "${TIMED[@]}" ;;
    megatron_local_l2_mbs1_level0) echo --num-layers 2 --micro-batch-size 1 --no-bias-swiglu-fusion "${LEVEL0[@]}" ;;
    megatron_sdpa_l4_mbs1_level0) echo --num-layers 4 --micro-batch-size 1 "${SDPA[@]}" "${LEVEL0[@]}" ;;
    megatron_sdpa_l4_mbs2_level0) echo --num-layers 4 --micro-batch-size 2 "${SDPA[@]}" "${LEVEL0[@]}" ;;
    megatron_local_l2_mbs2_snapshot)
      echo --num-layers 2 --micro-batch-size 2 --no-bias-swiglu-fusion --train-iters 3 --log-interval 3 \
        --record-memory-history --memory-snapshot-path "$2/memory_snapshot.pickle" ;;
    *) echo "lm_h200_cases: unknown case $1" >&2; return 2 ;;
  esac
}

CASES=("$@")
if [ ${#CASES[@]} -eq 0 ]; then
  CASES=(megatron_local_l2_mbs1 megatron_local_l2_mbs2 megatron_sdpa_l4_mbs1 megatron_sdpa_l4_mbs2)
  [ "${SNAPSHOT:-1}" = 1 ] && CASES+=(megatron_local_l2_mbs2_snapshot)
fi

if [ -n "${CHECK_ONLY:-}" ]; then
  for name in "${CASES[@]}"; do
    # shellcheck disable=SC2207
    args=($(case_args "$name" "$WORK/$name"))
    (cd "$MLM" && MEGATRON_LM="$MLM" "$PY" "$REPO/runs/megatron/megatron_cpu_memory.py" --parse-only -- \
      "${COMMON[@]}" "${args[@]}" --tensorboard-dir "$WORK/$name/tensorboard" 2>&1 | tail -n 1 | sed "s/^/$name: /") \
      | tee -a "$PROVENANCE"
  done
  log "CHECK_ONLY: prepared in $WORK, not training"
  exit 0
fi
"$PY" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"' || exit 2
log "device: $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo unknown)"
for pair in hta:holistictraceanalysis msgspec:msgspec; do  # the reconcile's: the HTA cross-check, the trace decoder
  "$PY" -c "import ${pair%%:*}" 2>/dev/null || { whl="$(ls "$WHEELS"/"${pair#*:}"-*.whl 2>/dev/null | head -n 1)"; \
    [ -n "$whl" ] && "$PY" -m zipfile -e "$whl" "$SITE" && log "${pair%%:*}: unpacked $(basename "$whl") for the reconcile"; \
  } || true
done

for name in "${CASES[@]}"; do
  elapsed=$((SECONDS - STARTED))
  if [ "$elapsed" -ge "${DEADLINE_S:-420}" ]; then
    echo "$name: not run ($elapsed s gone, past DEADLINE_S)" | tee -a "$SUMMARY"
    continue
  fi
  run="$WORK/$name"
  mkdir -p "$run/logs"
  cp "$PROVENANCE" "$run/logs/provenance.txt"
  # shellcheck disable=SC2207
  args=($(case_args "$name" "$run"))
  echo "pretrain_gpt.py ${COMMON[*]} ${args[*]} --tensorboard-dir $run/tensorboard" >>"$run/logs/provenance.txt"
  began=$SECONDS
  set +e
  (cd "$MLM" && CUDA_DEVICE_MAX_CONNECTIONS=1 timeout --kill-after=15 "${CASE_TIMEOUT_S:-110}" \
    "$PY" -m torch.distributed.run --standalone --nproc_per_node 1 "$ENTRY" "${COMMON[@]}" "${args[@]}" \
    --tensorboard-dir "$run/tensorboard") >"$run/logs/torchrun.log" 2>&1
  code=$?
  set -e
  echo "pretrain_gpt.py exit code $code$([ "$code" = 124 ] && echo ' (timed out)')" >>"$run/logs/provenance.txt"
  echo "$name: exit code $code in $((SECONDS - began)) s" | tee -a "$SUMMARY"
  grep -E "iteration +12/|iteration +3/|Error|error" "$run/logs/torchrun.log" | tail -n 3 >>"$SUMMARY" || true
  tar -czf "$OUT/$name.tgz" -C "$WORK" "$name"
  if [ "$(stat -c %s "$OUT/$name.tgz")" -gt 15000000 ]; then  # over what comes back: the run without its snapshot
    tar -czf "$OUT/$name.tgz" --exclude='*.pickle' -C "$WORK" "$name"
    echo "  the memory snapshot left out: the archive was over 15 MB with it" >>"$SUMMARY"
  fi
  echo "  $OUT/$name.tgz: $(stat -c %s "$OUT/$name.tgz") bytes" >>"$SUMMARY"
done

# a first look, while time is left: the ledger on a copy of each run (the run directories stay as Megatron wrote them)
for name in "${CASES[@]}"; do
  [ -d "$WORK/$name/tensorboard" ] || continue
  if [ $((SECONDS - STARTED)) -ge "${RECONCILE_DEADLINE_S:-450}" ]; then
    echo "$name: not reconciled here (time)" >>"$SUMMARY"
    continue
  fi
  mkdir -p "$WORK/check" && rm -rf "${WORK:?}/check/$name" && cp -r "$WORK/$name" "$WORK/check/"
  echo "== train-ledger reconcile $name --hardware H200" >>"$SUMMARY"
  (cd "$REPO" && PYTHONPATH="$REPO:$SITE" timeout 60 "$PY" -m cli.main reconcile "$WORK/check/$name" \
    --hardware H200 --out "$WORK/check/$name.ledger" 2>&1 | grep -v -E "^(Parsed|Overall|leaving|Rounding)" \
    | tail -n 40) >>"$SUMMARY" || echo "  reconcile exited $?" >>"$SUMMARY"
done
cat "$PROVENANCE" >>"$SUMMARY"
echo "lm_h200_cases: $((SECONDS - STARTED)) s; $(ls "$OUT" | tr '\n' ' ')"
