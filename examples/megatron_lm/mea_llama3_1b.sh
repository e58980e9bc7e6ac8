#!/bin/bash
# The MEA paper's recipe (Section 5.1) on the Llama-3.2-1B shape (the paper names the model; the
# sizes are Llama-3.2-1B's public config): 16 layers, hidden 2048, FFN 8192, GQA 32 query / 8 KV
# heads of dim 64, RoPE base 500000; untied input and output embeddings ("we do not employ weight
# tying"), AdamW with weight decay 0.1, ~20M-token batches (Section 5.1.1).
# Two modes, as in the paper:
#   MODE=lr-grid (default)  the learning-rate robustness runs (Section 5.1.2): linear warm-up over
#                           the first 1,000 steps, then the peak LR held constant, 50B tokens;
#                           the paper's grid is 1e-4, 5e-4, 1e-3, 3e-3 (LR_GRID below)
#   MODE=final              the final run (Section 5.1.3): the same warm-up, then cosine decay to
#                           10% of the peak LR over 500B tokens
# Ours, where the paper gives no number: sequence length 4096 (so 4864 sequences make 19.9M
# tokens), Adam betas 0.9 / 0.95, gradient clipping 1.0, init std 0.02, no dropout.
#
#   VARIANT=mea|baseline   MEA (HLC + head norm) or standard attention
#   LR                     peak learning rate; default 1e-3, but 3e-3 for MODE=final VARIANT=mea.
#                          The paper's final runs use "the maximum stable LR of each variant";
#                          the values themselves are not in the text we have. 3e-3 for MEA and
#                          1e-3 for the others is our inference from Appendix E (MEA stable up to
#                          3e-3, every other variant unstable above 1e-3)
#   TP, PP, MBS            parallel sizes and micro-batch (defaults 1, 1, 4)
#   DATA_PATH, TOKENIZER_MODEL, CHECKPOINT_DIR, TRAIN_TOKENS (default: 50e9, or 500e9 for final)
# plus the launch settings of common.sh (LAUNCH, NNODES, PRECISION, DRY_RUN, ...). The grid:
#   for lr in $LR_GRID; do LR=$lr LAUNCH=slurm NNODES=8 bash mea_llama3_1b.sh; done
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
SCRIPT="$MEA_EXAMPLES_DIR/$(basename "${BASH_SOURCE[0]}")"

LR_GRID="1e-4 5e-4 1e-3 3e-3"
MODE=${MODE:-lr-grid}
VARIANT=${VARIANT:-mea}
DEFAULT_LR=1e-3
[ "$MODE" = final ] && [ "$VARIANT" = mea ] && DEFAULT_LR=3e-3
LR=${LR:-$DEFAULT_LR}
TP=${TP:-1}
PP=${PP:-1}
MBS=${MBS:-4}
SEQ_LENGTH=4096
GLOBAL_BATCH=4864                      # 4864 x 4096 = 19,922,944 tokens per step (~20M)
WARMUP_ITERS=1000
case "$MODE" in
    lr-grid) TRAIN_TOKENS=${TRAIN_TOKENS:-50000000000}
             SCHEDULE_ARGS=(--lr-decay-style constant) ;;
    final) TRAIN_TOKENS=${TRAIN_TOKENS:-500000000000}
           SCHEDULE_ARGS=(--lr-decay-style cosine
                          --min-lr "$(awk -v lr="$LR" 'BEGIN { print lr / 10 }')") ;;
    *) echo "MODE must be lr-grid or final (got '$MODE')" >&2; exit 2 ;;
esac
TRAIN_ITERS=$((TRAIN_TOKENS / (GLOBAL_BATCH * SEQ_LENGTH)))
SCHEDULE_ARGS+=(--lr-warmup-iters "$WARMUP_ITERS" --lr-decay-iters "$TRAIN_ITERS")
CHECKPOINT_DIR=${CHECKPOINT_DIR:-./checkpoints/mea_llama3_1b_${MODE}_${VARIANT}_lr$LR}

MODEL_ARGS=(
    --num-layers 16
    --hidden-size 2048
    --ffn-hidden-size 8192
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 8
    --kv-channels 64
    --normalization RMSNorm
    --norm-epsilon 1e-5
    --swiglu
    --disable-bias-linear
    --position-embedding-type rope
    --rotary-base 500000
    --seq-length "$SEQ_LENGTH"
    --max-position-embeddings "$SEQ_LENGTH"
    --untie-embeddings-and-output-weights
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --init-method-std 0.02
)

case "$VARIANT" in
    baseline) ATTENTION_ARGS=(--attention-variant standard) ;;
    mea) ATTENTION_ARGS=(--attention-variant mea --mea-num-kv-components "${MEA_NC:-8}"
                         --mea-head-norm) ;;
    *) echo "VARIANT must be mea or baseline (got '$VARIANT')" >&2; exit 2 ;;
esac

TRAINING_ARGS=(
    --micro-batch-size "$MBS"
    --global-batch-size "$GLOBAL_BATCH"
    --train-iters "$TRAIN_ITERS"
    --lr "$LR"
    "${SCHEDULE_ARGS[@]}"
    --optimizer adam
    --adam-beta1 0.9
    --adam-beta2 0.95
    --weight-decay 0.1
    --clip-grad 1.0
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
)
if ((TP > 1)); then
    PARALLEL_ARGS+=(--sequence-parallel)
fi

precision_args

if [[ -n "${DATA_PATH:-}" ]]; then
    DATA_ARGS=(--data-path $DATA_PATH --split 99,1,0
        --tokenizer-type HuggingFaceTokenizer
        --tokenizer-model "${TOKENIZER_MODEL:-meta-llama/Llama-3.2-1B}")
else
    # NullTokenizer adds one EOD id: 128255 + 1 = the Llama-3 vocabulary.
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 128255)
fi

CHECKPOINT_ARGS=(
    --save "$CHECKPOINT_DIR"
    --load "$CHECKPOINT_DIR"
    --save-interval 500
    --ckpt-format torch_dist
)

LOGGING_ARGS=(
    --log-interval 10
    --log-throughput
    --eval-interval 500
    --eval-iters 10
    --tensorboard-dir "$CHECKPOINT_DIR/tensorboard"
)

launch "$SCRIPT" \
    "${MODEL_ARGS[@]}" "${ATTENTION_ARGS[@]}" "${TRAINING_ARGS[@]}" "${PARALLEL_ARGS[@]}" \
    "${PRECISION_ARGS[@]}" "${DATA_ARGS[@]}" "${CHECKPOINT_ARGS[@]}" "${LOGGING_ARGS[@]}"
