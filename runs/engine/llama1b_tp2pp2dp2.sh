#!/bin/bash
# train-ledger / runs/engine/llama1b_tp2pp2dp2.sh -- runs/megatron/run.sh on our engine: Llama-3.2-1B
# shape, 8 GPUs: TP2 x PP2 x DP2, sequence parallel, ZeRO-1 (distributed optimizer). Only the entry point changes
# (pretrain_gpt.py -> -m engine.train) and a run directory is added for the probes.
#   usage: runs/engine/llama1b_tp2pp2dp2.sh [RUN_DIR] [extra flags...]
set -euo pipefail
cd "$(dirname "$0")/../.."
RUN_DIR=${1:-runs/out/llama1b-tp2pp2dp2-$(date +%Y%m%d-%H%M%S)}
shift || true
torchrun --nproc_per_node 8 -m engine.train \
  --use-mcore-models --transformer-impl transformer_engine \
  --num-layers 16 --hidden-size 2048 --ffn-hidden-size 8192 \
  --num-attention-heads 32 --group-query-attention --num-query-groups 8 \
  --seq-length 8192 --max-position-embeddings 8192 --position-embedding-type rope --rotary-base 500000 \
  --swiglu --normalization RMSNorm --disable-bias-linear --untie-embeddings-and-output-weights \
  --attention-dropout 0.0 --hidden-dropout 0.0 \
  --tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --sequence-parallel \
  --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather \
  --micro-batch-size 1 --global-batch-size 16 \
  --bf16 --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 10 --train-iters 50 \
  --clip-grad 1.0 --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 \
  --mock-data --tokenizer-type NullTokenizer --vocab-size 128256 --split 99,1,0 \
  --log-interval 1 --log-memory-to-tensorboard --tensorboard-dir "$RUN_DIR/tb" \
  --use-pytorch-profiler --profile-step-start 20 --profile-step-end 22 --profile-ranks 0 1 2 3 4 5 6 7 \
  --eval-iters 0 --save-interval 1000000 \
  --distributed-timeout-minutes 30 \
  --run-dir "$RUN_DIR" "$@"
