#!/usr/bin/env bash
# The embedding's gradient added into main_grad by the lookup (the default) against the dense [V, h] gradient
# (--no-embedding-gradient-accumulation-fusion, Megatron's way) on one H200 (BENCHMARKS.md, "The embedding's
# gradient"), in parts (PARTS, in this order; each runs even if an earlier one failed):
#   dense  runs/bench/vs_megatron.py at issue Engine VII's dense shape (llama3.2-1b untied, seq 4096, 8 micro-batches):
#          ours, ours with the dense gradient, megatron-core, alternated over two rounds; the first round's runs of
#          ours kept in $OUT/dense_runs.tgz (no traces) for the ledger
#   small  the launch-bound lb_h1024_l4_s512 shape (tied, vocabulary 32,000), graphed and compiled, each with the
#          fusion and without, 20 steps with --all-probes, alternated over two rounds; run directories of the first
#          round in $OUT/small_runs.tgz, the step medians in small.txt
# Needs the wheels of ../.whl (nvtx, pynvml, msgspec; megatron-core for dense).
#     OUT=dir PARTS="dense small" bash runs/bench/embedding_grad_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/embedding_grad_h200}
PARTS=${PARTS:-dense small}
source runs/bench/device_setup.sh

dense() {
  rm -rf /tmp/keep && mkdir -p /tmp/keep
  python3 runs/bench/vs_megatron.py --seq 4096 --microbatches 8 --rounds 2 \
      --variants ours ours-dense-embedding-grad mcore --keep-runs /tmp/keep --out "$OUT/vs_megatron_embedding.json" \
      > "$OUT/vs_megatron_embedding.log" 2>&1
  echo "vs_megatron exit $?"
  tail -n 25 "$OUT/vs_megatron_embedding.log"
  local first
  first=$(ls -d /tmp/keep/train-ledger_s4096_* | sort | head -n 1)
  tar czf "$OUT/dense_runs.tgz" -C /tmp/keep "$(basename "$first")"
}

small() {
  local names=()
  for round in 1 2; do
    for kind in graphed compiled; do
      local extra=()
      [ "$kind" = graphed ] && extra=(--cuda-graph-impl local)
      for grad in rows dense; do
        local name="lb_${kind}_${grad}_r$round" flags=()
        [ "$grad" = dense ] && flags=(--no-embedding-gradient-accumulation-fusion)
        rm -rf "runs/out/$name"
        python3 -m cli train --nproc-per-node 1 --bf16 --use-distributed-optimizer "${ADAM[@]}" "${LB1024[@]}" \
            --all-probes --train-iters 20 "${extra[@]}" "${flags[@]}" --run-dir "runs/out/$name" 2>&1 | tail -n 1
        names+=("runs/out/$name")
      done
    done
  done
  python3 - "${names[@]}" <<'PY' | tee "$OUT/small.txt"
import json, statistics, sys
for run in sys.argv[1:]:
    events = [json.loads(line) for line in open(run + "/ranks/rank0/events.jsonl")]
    steps = [e["step_time_s"] for e in events if e["kind"] == "step" and e["step"] > 2]
    backward = [e["duration_s"] for e in events if e["kind"] == "timing" and e["step"] > 2
                and e.get("category") == "backward"]
    print(f"{run.split('/')[-1]:28s} step median {statistics.median(steps) * 1e3:7.2f} ms (min "
          f"{min(steps) * 1e3:6.2f}) backward median {statistics.median(backward) * 1e3:6.2f} ms")
PY
  tar czf "$OUT/small_runs.tgz" -C runs/out $(for n in "${names[@]}"; do case $n in *_r1) basename "$n";; esac; done)
}

for part in $PARTS; do "$part"; done
