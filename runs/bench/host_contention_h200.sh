#!/usr/bin/env bash
# Two questions on one H200 (BENCHMARKS.md, "Other processes on the GPU" and "The training loop's host"), in parts
# (PARTS, in this order; each runs even if an earlier one failed):
#   nvml        llama3.2-1b at seq 2048 (4 micro-batches, 8 steps, timers and NVML every 0.1 s) alone, then again
#               while another process holds 4 GiB on the same GPU: the nvml probe's per-process split and the
#               ledger's memory.outside_pytorch / memory.other_processes rows; run directories in $OUT/nvml_runs.tgz
#   contention  the launch-bound lb_h1024_l4_s512 shape (the committed fixture's), compiled and graphed, 20 steps
#               with --all-probes (the start-up pass timings) under runs/bench/host_contention.py's variants:
#               default, prefetch-all (the loader thread idle during steps), prefetch-all,gc-off; run directories
#               in $OUT/contention_runs.tgz and the ranges per variant in contention.txt
#   conditions  the same shape compiled and graphed, 12 steps, with the pass-conditions variant: the start-up passes
#               timed after the host slept, spun or read memory, beside the training ranges (conditions.txt)
#   idle        runs whose host sweep times pass.forward_after_idle, for the time model's first forward: lb_h1024
#               graphed, lb_h512_l12_s256 graphed and compiled, and the 2-layer llama3.2-1b at seq 1024, 20 steps
#               with --all-probes; run directories in $OUT/idle_runs.tgz, the ranges in idle.txt
# Needs the wheels of ../.whl (nvtx, pynvml, msgspec).
#     OUT=dir [ROUNDS=2] PARTS="nvml contention" bash runs/bench/host_contention_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/host_contention_h200}
PARTS=${PARTS:-nvml contention}
source runs/bench/device_setup.sh

BASE=(--bf16 --use-distributed-optimizer "${ADAM[@]}")
train() {
  local name=$1; shift
  rm -rf "runs/out/$name"
  local t0=$SECONDS
  python3 -m cli train --nproc-per-node 1 "${BASE[@]}" "$@" --run-dir "runs/out/$name" 2>&1 | tail -n 1
  echo "$name: $((SECONDS - t0)) s"
}

nvml() {
  local shape=(--model llama3.2-1b --seq-length 2048 --micro-batch-size 1 --global-batch-size 4 --train-iters 8
               --timers --nvml-interval 0.1)
  train nvml_alone "${shape[@]}"
  rm -f /tmp/cotenant.ready
  python3 -c "import sys, time, torch; x = torch.empty(4 << 30, dtype=torch.uint8, device='cuda'); \
open(sys.argv[1], 'w').close(); time.sleep(900)" /tmp/cotenant.ready &
  local cotenant=$!
  while [ ! -f /tmp/cotenant.ready ]; do sleep 0.5; done
  nvidia-smi --query-compute-apps=pid,used_memory --format=csv > "$OUT/cotenant_apps.csv" 2>&1
  train nvml_cotenant "${shape[@]}"
  kill "$cotenant"; wait "$cotenant" 2>/dev/null
  for run in nvml_alone nvml_cotenant; do
    python3 -m cli reconcile "runs/out/$run" > /dev/null 2>&1
    python3 - "runs/out/$run" <<'PY'
import json, sys
rows = json.load(open(sys.argv[1] + "/ledger/reconciliation.json"))["rows"]
for r in rows:
    if r["metric"] in ("memory.outside_pytorch", "memory.other_processes", "memory.device_total"):
        print(sys.argv[1], r["metric"], r["verdict"], r["measured"], r["predicted"], r["explanation"][:160])
PY
  done
  cat "$OUT/cotenant_apps.csv"
  tar czf "$OUT/nvml_runs.tgz" -C runs/out nvml_alone nvml_cotenant
}

variant() {
  local name=$1 chosen=$2; shift 2
  rm -rf "runs/out/$name"
  local t0=$SECONDS
  python3 -m torch.distributed.run --standalone --nproc-per-node 1 runs/bench/host_contention.py --variant "$chosen" \
      -- "${BASE[@]}" "${LB1024[@]}" --all-probes --train-iters 20 "$@" --run-dir "runs/out/$name" 2>&1 | tail -n 1
  echo "$name ($chosen): $((SECONDS - t0)) s"
}
summary() {
  python3 - "$@" <<'PY'
import json, statistics, sys
for run in sys.argv[1:]:
    events = [json.loads(line) for line in open(run + "/ranks/rank0/events.jsonl")]
    steps = [e["step_time_s"] for e in events if e["kind"] == "step" and e["step"] > 2]
    ranges = {}
    for e in events:
        if e["kind"] == "timing" and e["step"] > 2 and e.get("category") in ("forward", "backward"):
            mb = int(e["name"].split(" mb")[1])
            ranges.setdefault((e["category"], mb == 0), []).append(e["duration_s"])
    passes = {e["op"]: e["seconds"] for e in events if e["kind"] == "host" and e["op"].startswith("pass.")}
    med = lambda xs: statistics.median(xs) * 1e3 if xs else float("nan")
    print(f"{run.split('/')[-1]:34s} step median {med(steps):7.2f} ms (min {min(steps) * 1e3:6.2f}, max "
          f"{max(steps) * 1e3:6.2f}) | forward mb0 {med(ranges.get(('forward', True), [])):6.2f} others "
          f"{med(ranges.get(('forward', False), [])):6.2f} | backward mb0 {med(ranges.get(('backward', True), [])):6.2f}"
          f" others {med(ranges.get(('backward', False), [])):6.2f} | start-up pass forward "
          f"{passes.get('pass.forward', float('nan')) * 1e3:5.2f} backward {passes.get('pass.backward', float('nan')) * 1e3:5.2f}"
          f" forward after idle {passes.get('pass.forward_after_idle', float('nan')) * 1e3:5.2f}")
PY
}
contention() {
  local names=()
  for round in $(seq 1 "${ROUNDS:-2}"); do
    for v in default prefetch-all prefetch-all,gc-off; do
      variant "lb_compiled_${v//,/_}_r$round" "$v"; names+=("runs/out/lb_compiled_${v//,/_}_r$round")
    done
    for v in default prefetch-all; do
      variant "lb_graphed_${v//,/_}_r$round" "$v" --cuda-graph-impl local
      names+=("runs/out/lb_graphed_${v//,/_}_r$round")
    done
  done
  summary "${names[@]}" | tee "$OUT/contention.txt"
  tar czf "$OUT/contention_runs.tgz" -C runs/out $(for n in "${names[@]}"; do basename "$n"; done)
}

conditions() {
  local names=()
  for kind in compiled graphed; do
    local name="lb_${kind}_conditions" extra=()
    [ "$kind" = graphed ] && extra=(--cuda-graph-impl local)
    rm -rf "runs/out/$name"
    python3 -m torch.distributed.run --standalone --nproc-per-node 1 runs/bench/host_contention.py \
        --variant pass-conditions -- "${BASE[@]}" "${LB1024[@]}" --all-probes --train-iters 12 "${extra[@]}" \
        --run-dir "runs/out/$name" 2>&1 | grep -E "PASS_CONDITIONS|Error|error" | tee -a "$OUT/conditions.txt"
    names+=("runs/out/$name")
  done
  summary "${names[@]}" | tee -a "$OUT/conditions.txt"
}

LB512=(--model llama3.2-1b --num-layers 12 --hidden-size 512 --ffn-hidden-size 2048 --num-attention-heads 8
       --num-query-groups 8 --seq-length 256 --max-position-embeddings 256 --micro-batch-size 4 --global-batch-size 16)
idle() {
  train idle_lb_h1024_graphed "${LB1024[@]}" --all-probes --train-iters 20 --cuda-graph-impl local
  train idle_lb_h512_graphed "${LB512[@]}" --all-probes --train-iters 20 --cuda-graph-impl local
  train idle_lb_h512_compiled "${LB512[@]}" --all-probes --train-iters 20
  train idle_h200_2layer --model llama3.2-1b --num-layers 2 --seq-length 1024 --micro-batch-size 1 \
      --global-batch-size 4 --all-probes --train-iters 20
  local names=(runs/out/idle_lb_h1024_graphed runs/out/idle_lb_h512_graphed runs/out/idle_lb_h512_compiled
               runs/out/idle_h200_2layer)
  summary "${names[@]}" | tee "$OUT/idle.txt"
  tar czf "$OUT/idle_runs.tgz" -C runs/out $(for n in "${names[@]}"; do basename "$n"; done)
}

for part in $PARTS; do "$part"; done
