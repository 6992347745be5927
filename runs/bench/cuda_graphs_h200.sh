#!/usr/bin/env bash
# Per-layer CUDA graphs (--cuda-graph-impl local) on one H200 (BENCHMARKS.md, "CUDA graphs"), in parts (PARTS, in this
# order; each runs even if an earlier one failed):
#   sweep     the host sweep alone, the graph primitives included (graph_node, graphed_call, graphed_backward)
#   runs      launch-bound shapes graphed and compiled, each with --all-probes (its own host and compute sweeps) and a
#             profiler window: lb_h1024_l4_s512 (the committed launch-bound fixture's shape) and lb_h512_l12_s256;
#             their run directories in $OUT/lb_runs.tgz, for the ledger to judge off the device
#   gpubound  two GPU-bound shapes with --all-probes and a profiler window, each run directory into $OUT/gpubound.tgz:
#             h200_2layer (llama3.2-1b cut to 2 layers, seq 1024, the host timeline's calibration shape) and
#             llama1b_s4096 (all 16 layers, seq 4096, 4 micro-batches)
#   snapshot  lb_h1024_l4_s512 graphed with --record-memory-history (what the graphs' pool holds), $OUT/snapshot.tgz
#   small     runs/bench/engine_vii.py's launch-bound section: eager, compiled and graphed alternated over two
#             rounds, tokens/s and whether the graphed losses equal the compiled ones
#   dense     runs/bench/engine_vii.py's dense section with the graphed lever: ours, megatron-core, ours-graphed
# Needs the wheels of ../.whl (nvtx, pynvml, HolisticTraceAnalysis, msgspec; megatron-core for dense).
#     OUT=dir PARTS="sweep runs snapshot small dense" bash runs/bench/cuda_graphs_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/cuda_graphs_h200}
PARTS=${PARTS:-sweep runs snapshot small}
source runs/bench/device_setup.sh

sweep() {
  host_sweep_records "$OUT/host_sweep.jsonl"
}

LB512=(--model llama3.2-1b --num-layers 12 --hidden-size 512 --ffn-hidden-size 2048 --num-attention-heads 8
       --num-query-groups 8 --seq-length 256 --max-position-embeddings 256 --micro-batch-size 4 --global-batch-size 16)
train() {
  local name=$1; shift
  rm -rf "runs/out/$name"
  local t0=$SECONDS
  python3 -m cli train --nproc-per-node 1 --bf16 --use-distributed-optimizer "${ADAM[@]}" "$@" \
      --run-dir "runs/out/$name" 2>&1 | tail -n 2
  echo "$name: $((SECONDS - t0)) s"
}
profiled() {
  local name=$1; shift
  train "$name" --all-probes --use-pytorch-profiler --train-iters 9 --profile-step-start 5 --profile-step-end 6 "$@"
}

runs() {
  profiled lb_h1024_l4_s512_graphed "${LB1024[@]}" --cuda-graph-impl local
  profiled lb_h1024_l4_s512_compiled "${LB1024[@]}"
  profiled lb_h512_l12_s256_graphed "${LB512[@]}" --cuda-graph-impl local
  profiled lb_h512_l12_s256_compiled "${LB512[@]}"
  tar czf "$OUT/lb_runs.tgz" -C runs/out lb_h1024_l4_s512_graphed lb_h1024_l4_s512_compiled \
      lb_h512_l12_s256_graphed lb_h512_l12_s256_compiled
}

gpubound() {
  profiled h200_2layer --model llama3.2-1b --num-layers 2 --seq-length 1024 --micro-batch-size 1 \
      --global-batch-size 4
  profiled llama1b_s4096 --model llama3.2-1b --seq-length 4096 --micro-batch-size 1 --global-batch-size 4
  tar czf "$OUT/gpubound.tgz" -C runs/out h200_2layer llama1b_s4096
}

snapshot() {
  train lb_h1024_l4_s512_graphed_snapshot "${LB1024[@]}" --cuda-graph-impl local --train-iters 4 --timers \
      --record-memory-history
  tar czf "$OUT/snapshot.tgz" -C runs/out lb_h1024_l4_s512_graphed_snapshot
}

small() {
  python3 runs/bench/engine_vii.py --sections small --rounds 2 --budget-s 300 --out "$OUT/small.json" \
      2>&1 | grep -v "^\\$" | tee "$OUT/small.log" | tail -n 12
}

dense() {
  python3 runs/bench/engine_vii.py --sections dense --rounds 2 --lever-rounds 2 --levers ours-graphed \
      --budget-s "${DENSE_BUDGET_S:-300}" --out "$OUT/dense.json" 2>&1 | grep -v "^\\$" | tee "$OUT/dense.log" | tail -n 12
}

for part in $PARTS; do
  echo "== $part"
  "$part" || echo "$part FAILED"
done
ls -la "$OUT"
