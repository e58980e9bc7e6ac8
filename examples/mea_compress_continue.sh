#!/bin/bash
# MEA post-hoc KV compression and the continued pretraining after it, with the MEA paper's numbers
# (Section 5.2.1, Appendix F: Qwen3-30B-A3B, 4 -> 2 KV heads, half the KV cache):
#   1. import the Hugging Face model as a Megatron checkpoint (mea-convert import-hf);
#   2. optionally rank the layers by the loss of compressing each alone (PROBE=1: mea-convert probe);
#   3. compress K/V of the chosen layers by an SVD over heads (mea-convert compress); the layers left
#      out stay standard attention, as in the paper;
#   4. continue pretraining (mea-pretrain): AdamW, peak LR 1.6e-5, linear warm-up, cosine decay
#      to 0, ~68M-token batches (16384 x 4096), ~22B tokens.
#
# The paper's layer settings (LAYERS=): all (all 48 layers), paper-half (Hugging Face layers
# 11-34, 0-based), all-but-first-3. Full compression needs a longer recovery stage in the paper
# (about 1T tokens): raise TRAIN_TOKENS.
#
# Assumptions, where the paper leaves a number open or its numbers conflict:
# - sequence length 4096 (16384 sequences = 67.1M tokens per step);
# - AdamW's weight decay 0.1 and betas 0.9 / 0.95 (the paper names AdamW only);
# - warm-up: the paper's 1,000 steps exceed the ~328 steps that 22B tokens make at 68M tokens per
#   step, so WARMUP_ITERS defaults to 1,000 only for runs longer than 10,000 steps and to 10% of
#   the steps otherwise (set WARMUP_ITERS to choose);
# - gradient clipping 1.0, bf16, the distributed optimizer.
#
# Environment:
#   HF_DIR            the Hugging Face model (default ./Qwen3-30B-A3B), also the tokenizer
#   DATA_PATH         Megatron dataset prefix(es) (mea-preprocess writes them)
#   WORK_DIR          where the imported and compressed checkpoints go (default ./mea_compress)
#   NC, LAYERS        components per layer (default 2) and the layer setting (default all)
#   PROBE=1           run the per-layer probe first (prints the ranking)
#   TP, EP, PP        parallel sizes of the continued pretraining (defaults 1, 8, 1)
#   GPUS_PER_NODE, NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT   torchrun (defaults 8, 1, 0,
#                     127.0.0.1, 6000)
#   TRAIN_TOKENS      default 22e9; WARMUP_ITERS: see above
#   DRY_RUN=1         print the commands (and the schedule) instead of running them
set -euo pipefail

HF_DIR=${HF_DIR:-./Qwen3-30B-A3B}
DATA_PATH=${DATA_PATH:-}
WORK_DIR=${WORK_DIR:-./mea_compress}
NC=${NC:-2}
LAYERS=${LAYERS:-all}
PROBE=${PROBE:-0}
TP=${TP:-1}
EP=${EP:-8}
PP=${PP:-1}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-6000}
DRY_RUN=${DRY_RUN:-0}

SEQ_LENGTH=4096
GLOBAL_BATCH=16384                     # 16384 x 4096 = 67,108,864 tokens per step (~68M)
TRAIN_TOKENS=${TRAIN_TOKENS:-22000000000}
TRAIN_ITERS=$(awk -v t="$TRAIN_TOKENS" -v b=$((GLOBAL_BATCH * SEQ_LENGTH)) \
    'BEGIN { printf "%d", (t + b - 1) / b }')
if [[ -z "${WARMUP_ITERS:-}" ]]; then
    if ((TRAIN_ITERS > 10000)); then WARMUP_ITERS=1000; else WARMUP_ITERS=$((TRAIN_ITERS / 10)); fi
fi
IMPORTED="$WORK_DIR/imported"
COMPRESSED="$WORK_DIR/compressed_nc${NC}_${LAYERS}"
CHECKPOINT_DIR=${CHECKPOINT_DIR:-$WORK_DIR/continued_nc${NC}_${LAYERS}}

run() {
    if [[ "$DRY_RUN" == 1 ]]; then
        printf '%q ' "$@"
        echo
    else
        "$@"
    fi
}

if [[ -z "$DATA_PATH" && "$DRY_RUN" != 1 ]]; then
    echo "DATA_PATH is required (a Megatron dataset prefix; see mea-preprocess)" >&2
    exit 2
fi
DATA_PATH=${DATA_PATH:-DATA_PREFIX}
echo "schedule: $TRAIN_ITERS steps of $((GLOBAL_BATCH * SEQ_LENGTH)) tokens," \
     "warm-up $WARMUP_ITERS, LR 1.6e-5 cosine to 0"

run mea-convert import-hf --hf-dir "$HF_DIR" --save "$IMPORTED"
if [[ "$PROBE" == 1 ]]; then
    run mea-convert probe --load "$IMPORTED" --num-kv-components "$NC" --data-path "$DATA_PATH"
fi
run mea-convert compress --load "$IMPORTED" --save "$COMPRESSED" --num-kv-components "$NC" \
    --layers "$LAYERS"

PRETRAIN_ARGS=(
    --config "$COMPRESSED/config.yaml"
    --load "$COMPRESSED"
    --save "$CHECKPOINT_DIR"
    --seq-length "$SEQ_LENGTH"
    --micro-batch-size 1
    --global-batch-size "$GLOBAL_BATCH"
    --train-iters "$TRAIN_ITERS"
    --lr 1.6e-5
    --min-lr 0
    --lr-decay-style cosine
    --lr-warmup-iters "$WARMUP_ITERS"
    --weight-decay 0.1
    --adam-beta1 0.9
    --adam-beta2 0.95
    --clip-grad 1.0
    --bf16
    --use-distributed-optimizer
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --expert-model-parallel-size "$EP"
    --data-path "$DATA_PATH"
    --tokenizer-type HuggingFaceTokenizer
    --tokenizer-model "$HF_DIR"
    --save-interval 100
    --eval-interval 100
    --eval-iters 10
)
if ((TP > 1)); then PRETRAIN_ARGS+=(--sequence-parallel); fi

run torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
    --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" \
    -m megatron_mea.cli.pretrain "${PRETRAIN_ARGS[@]}"
