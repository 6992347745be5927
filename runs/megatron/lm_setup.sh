# train-ledger / runs/megatron/lm_setup.sh -- sourced by lm_tensorboard_run.sh and lm_h200_cases.sh: Megatron-LM
# made runnable offline from a carried source tree, every step logged to $PROVENANCE.
#
# Expects REPO, MLM_SRC (the Megatron-LM source: megatron/, pretrain_gpt.py, gpt_builders.py, model_provider.py,
# LICENSE, MEGATRON_SHA, prebuilt/), WHEELS (PyYAML, pybind11, einops), WORK (emptied here), PY and PROVENANCE.
# Leaves MLM (the working copy), ENTRY (the script to launch), PYTHONPATH (the copy, the unpacked wheels and
# runs/megatron for megatron_sdpa_spec) and log(). What it does and why:
#   - a wheel is unpacked into a private site folder only where the machine lacks the module;
#   - Megatron compiles its dataset helper (helpers.cpp, pybind11) at start-up with make + g++ + python3-config and
#     exits if that fails: it is built here first; where it cannot be, the helper prebuilt from the same helpers.cpp
#     for CPython 3.12 (MLM_SRC/prebuilt/) is used and Megatron's own make call is answered by a no-op;
#   - without triton (Megatron imports @triton.jit MoE kernels at module level; a dense GPT never runs them) a
#     stand-in module is put in place after torch's compile stack is loaded.

[ -f "$MLM_SRC/pretrain_gpt.py" ] || { echo "lm_setup: no pretrain_gpt.py in $MLM_SRC" >&2; exit 2; }
rm -rf "$WORK"
SITE="$WORK/site"
MLM="$WORK/Megatron-LM"
DATASETS="$MLM/megatron/core/datasets"
mkdir -p "$SITE" "$(dirname "$PROVENANCE")"
cp -r "$MLM_SRC" "$MLM"
log() { echo "lm_setup: $*" | tee -a "$PROVENANCE"; }
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
export PYTHONPATH="$MLM:$SITE:$REPO/runs/megatron"

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
