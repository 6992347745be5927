#!/usr/bin/env bash
# The host timeline's inputs on one H200 (BENCHMARKS.md, "The host timeline"): (a) the host sweep alone
# (probes/host_sweep.py: each host primitive's seconds per call, plain and under torch.profiler), its records and the
# H200 hardware file's `host` entry built from them; (b) three launch-bound runs with --all-probes (so each carries
# its own host sweep) and a profiler window: the two launch-bound shapes of runs/bench/ledger_inputs_h200.sh again
# and a small MoE (2 layers, 8 experts top-2: its token counts are read on the host every layer), each run directory
# tarred into $OUT. Reconcile them off the device (torch-free). About 5 minutes. Needs the wheels of ../.whl
# (nvtx, pynvml, HolisticTraceAnalysis, msgspec: cp312 manylinux x86_64).      OUT=dir bash runs/bench/host_sweep_h200.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/host_sweep_h200}
source runs/bench/device_setup.sh
lscpu > "$OUT/lscpu.txt"
# (a) the host sweep alone, on the GPU, plain and profiled
host_sweep_records "$OUT/host_sweep.jsonl"
python3 runs/bench/host_block.py --sweep "$OUT/host_sweep.jsonl" --out "$OUT/h200_host_block.json" > /dev/null
# (b) launch-bound runs carrying their own host sweep
run() {
  local name=$1; shift
  rm -rf "runs/out/$name"
  local t0=$SECONDS
  python3 -m cli train --nproc-per-node 1 --bf16 --use-distributed-optimizer "${ADAM[@]}" --all-probes \
      --use-pytorch-profiler --train-iters 9 --profile-step-start 5 --profile-step-end 6 "$@" \
      --run-dir "runs/out/$name" 2>&1 | tail -n 3
  echo "$name: $((SECONDS - t0)) s"
  tar czf "$OUT/$name.tgz" -C runs/out "$name"
}
run lb_h1024_l4_s512 --model llama3.2-1b --num-layers 4 --hidden-size 1024 --ffn-hidden-size 4096 \
    --num-attention-heads 16 --num-query-groups 4 --seq-length 512 --max-position-embeddings 512 \
    --micro-batch-size 2 --global-batch-size 8
run lb_h512_l12_s256 --model llama3.2-1b --num-layers 12 --hidden-size 512 --ffn-hidden-size 2048 \
    --num-attention-heads 8 --num-query-groups 8 --seq-length 256 --max-position-embeddings 256 \
    --micro-batch-size 4 --global-batch-size 16
run lb_moe_h1024_l2_s1024 --model llama3.2-1b --num-layers 2 --hidden-size 1024 --ffn-hidden-size 4096 \
    --num-attention-heads 16 --num-query-groups 4 --seq-length 1024 --max-position-embeddings 1024 \
    --num-experts 8 --moe-router-topk 2 --moe-aux-loss-coeff 0.02 --micro-batch-size 1 --global-batch-size 4
ls -la "$OUT"
