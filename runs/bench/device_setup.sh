# Sourced by runs/bench's device scripts once they have cd'd to the repository root and set OUT: NCCL without NVLink
# multicast (the device docs ask it), the wheels carried in .whl installed into /tmp/site and put first on
# PYTHONPATH, and $OUT/device.txt naming the GPU, its driver, torch and the host's CPU (no git revision: the device's
# copy of the checkout can carry a stale one; the commit goes into BENCHMARKS.md instead); step_summary LOG prints a
# training log's steps after the first: min, median, max. The wheels the device image lacks (cp312, --no-deps):
# nvtx pynvml msgspec psutil pyyaml einops megatron-core==0.19.2 HolisticTraceAnalysis==0.5.0 and plotly (HTA imports
# it: without it a run reconciled there says its HTA cross-check stopped).
mkdir -p "$OUT" runs/out
export NCCL_NVLS_ENABLE=0 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
export PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
{ nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; python3 -c "import torch; print(torch.__version__)"
  lscpu | grep -E "Model name|^CPU\(s\)"; } > "$OUT/device.txt"

# What the device scripts' training runs share: the optimizer's flags, and the launch-bound shape (llama3.2-1b's layer
# cut to 4 layers of hidden 1024, seq 512, micro-batch 2, 4 micro-batches a step) most of them measure
ADAM=(--lr 3e-4 --min-lr 3e-5 --lr-warmup-iters 1 --weight-decay 0.1 --clip-grad 1.0)
LB1024=(--model llama3.2-1b --num-layers 4 --hidden-size 1024 --ffn-hidden-size 4096 --num-attention-heads 16
        --num-query-groups 4 --seq-length 512 --max-position-embeddings 512 --micro-batch-size 2 --global-batch-size 8)

step_summary() {  # $1: an `engine.train` log
  grep -o "step time (ms): [0-9.]*" "$1" | tail -n +2 | awk '{print $4}' | sort -n \
    | awk '{t[NR] = $1} END {printf "  steps 2-%d: min %.1f median %.1f max %.1f ms\n", NR + 1, t[1], t[int((NR + 1) / 2)], t[NR]}'
}

host_sweep_records() {  # $1: a host_sweep.jsonl to write: probes/host_sweep.py alone on the GPU, plain and profiled
  python3 - "$1" <<'PY'
import json, sys, time
import torch
from probes.host_sweep import run
t0 = time.perf_counter()
records = run(torch.device("cuda", 0), profiled=True)
with open(sys.argv[1], "w") as f:
    for r in records:
        f.write(json.dumps({"kind": "host", "step": None, **r}) + "\n")
print(f"host sweep: {len(records)} primitives in {time.perf_counter() - t0:.1f} s")
for r in records:
    print(f"  {r['op']:20s} {r['seconds'] * 1e6:8.2f} us   profiled {r.get('profiled_seconds', 0) * 1e6:8.2f} us")
PY
}
