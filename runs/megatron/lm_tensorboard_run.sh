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
# MEGATRON_SHA of the tag) is carried in MEGATRON_LM (default .mlm), the wheels Megatron needs beyond torch, numpy
# and tensorboard in WHEELS (default .whl: PyYAML, pybind11, einops); a wheel is unpacked into a private site folder
# only where the machine lacks the module. Megatron compiles its dataset helper (helpers.cpp, pybind11) at start-up
# with make + g++ + python3-config and exits if that fails: it is built here first; where it cannot be, the helper
# prebuilt from the same helpers.cpp for CPython 3.12 (MEGATRON_LM/prebuilt/) is used and Megatron's own make call is
# answered by a no-op. Without triton (Megatron imports @triton.jit MoE kernels at module level; a dense GPT never
# runs them) a stand-in module is put in place after torch's compile stack is loaded. Each of those is logged.
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
SITE="$WORK/site"
MLM="$WORK/Megatron-LM"
DATASETS="$MLM/megatron/core/datasets"

[ -f "$MLM_SRC/pretrain_gpt.py" ] || { echo "lm_tensorboard_run: no pretrain_gpt.py in $MLM_SRC" >&2; exit 2; }
rm -rf "$WORK"
mkdir -p "$OUT" "$SITE" "$RUN/logs"
cp -r "$MLM_SRC" "$MLM"
PROVENANCE="$RUN/logs/provenance.txt"
log() { echo "lm_tensorboard_run: $*" | tee -a "$PROVENANCE"; }
log "Megatron-LM $(cat "$MLM/MEGATRON_SHA" 2>/dev/null || echo '(sha unknown)') from $MLM_SRC"
log "python $("$PY" -c 'import sys; print(sys.version.split()[0])'); $("$PY" -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)')"

need() {  # need MODULE WHEEL_GLOB: the machine's module, else the carried wheel unpacked into $SITE
  if "$PY" -c "import $1" 2>/dev/null; then log "$1: the machine's"; return; fi
  local whl
  whl="$(ls "$WHEELS"/$2 2>/dev/null | head -n 1)"
  [ -n "$whl" ] || { log "$1 is missing and $WHEELS has no $2"; exit 2; }
  "$PY" -m zipfile -e "$whl" "$SITE"
  log "$1: unpacked $(basename "$whl")"
}
need yaml 'pyyaml-*.whl'
need pybind11 'pybind11-*.whl'
need einops 'einops-*.whl'
export PYTHONPATH="$MLM:$SITE"

# Megatron's dataset helper: built here by Megatron's own Makefile (it must then import in this Python), else the
# prebuilt one
helper_imports() { (cd "$DATASETS" && "$PY" -c "import helpers_cpp"); }
if (cd "$DATASETS" && make && helper_imports) >"$WORK/helpers_make.log" 2>&1; then
  log "dataset helper: built here by Megatron's Makefile ($(ls "$DATASETS"/helpers_cpp*.so | xargs -n 1 basename))"
else
  rm -f "$DATASETS"/helpers_cpp*.so
  SUFFIX="$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"
  log "dataset helper: Megatron's make failed here ($(tail -n 1 "$WORK/helpers_make.log")); using prebuilt/helpers_cpp$SUFFIX"
  cp "$MLM/prebuilt/helpers_cpp$SUFFIX" "$DATASETS/" || { log "no prebuilt helper for $SUFFIX"; exit 2; }
  helper_imports || { log "the prebuilt dataset helper does not import"; exit 2; }
fi
if ! (cd "$DATASETS" && make -q) >/dev/null 2>&1; then
  mkdir -p "$WORK/bin"
  printf '#!/bin/sh\nexit 0\n' >"$WORK/bin/make"
  chmod +x "$WORK/bin/make"
  export PATH="$WORK/bin:$PATH"
  log "make: a no-op stand-in on PATH answers Megatron's start-up build call (the helper above is in place)"
fi

ENTRY=pretrain_gpt.py
if "$PY" -c "import triton" 2>/dev/null; then
  log "triton: the machine's ($("$PY" -c 'import triton; print(triton.__version__)'))"
else
  ENTRY="$WORK/pretrain_gpt_without_triton.py"
  cat >"$ENTRY" <<'PY'
"""Megatron-LM's pretrain_gpt.py where triton is not installed: torch's compile stack is loaded and asked about
triton first (it caches "no triton" and takes its no-triton paths), then a stand-in `triton` lets Megatron's
module-level @triton.jit kernels (MoE, SSM) import; a dense GPT never runs them."""
import runpy
import sys
import types

import torch
import torch._inductor.runtime.hints  # noqa: F401
import torch.utils._triton as torch_triton

torch.compile(lambda x: x)
torch_triton.has_triton_package()
torch_triton.has_triton()


def _annotation(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return object  # tl.constexpr, tl.int32, ...: used as annotations only


triton = types.ModuleType("triton")
triton.__version__ = "0.0.0"  # a stand-in; Megatron parses the version
triton.jit = lambda fn=None, **kw: fn if fn is not None else (lambda f: f)
triton.autotune = triton.heuristics = lambda *a, **kw: (lambda f: f)
triton.Config = lambda *a, **kw: None
language = types.ModuleType("triton.language")
language.__getattr__ = _annotation
language.constexpr = lambda value=None: value  # Megatron evaluates tl.constexpr(...) at import
triton.language = language
sys.modules.update({"triton": triton, "triton.language": language})
sys.argv[0] = "pretrain_gpt.py"
runpy.run_path("pretrain_gpt.py", run_name="__main__")
PY
  log "triton: not installed; a stand-in module (pretrain_gpt_without_triton.py)"
fi

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
