#!/usr/bin/env bash
# FP8 against bf16 on one H200 (BENCHMARKS.md, "FP8"): runs/bench/fp8.py at its defaults (llama3.1-8b cut to 4 layers,
# seq 8192, 4 micro-batches of 1, 50 steps each, every probe on). Needs the wheels of ../.whl: torchao 0.18.0, nvtx,
# pynvml, msgspec (HolisticTraceAnalysis, psutil and pyyaml for the ledger's HTA cross-check).
#     OUT=dir [ITERS=50] bash runs/bench/fp8_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/fp8_h200}
WORK=/tmp/fp8_work
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, torchao; print(torch.__version__, 'torchao', torchao.__version__)"
  lscpu | grep -E "Model name|^CPU\(s\)"; git rev-parse HEAD 2>/dev/null; } > "$OUT/device.txt" 2>&1
python3 runs/bench/fp8.py --out "$WORK" --iters "${ITERS:-50}" > "$OUT/fp8.log" 2>&1
echo "fp8.py exit $?"
cp "$WORK/fp8.json" "$WORK/runs.tgz" "$OUT/" 2>/dev/null
tail -n 80 "$OUT/fp8.log"
