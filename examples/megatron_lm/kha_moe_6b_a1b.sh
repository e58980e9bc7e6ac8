#!/bin/bash
# The KHA paper's main model (Section 4.1): a 6.1B-total / 1.01B-active MoE (128 experts, top-8),
# GQA 32 query / 4 KV heads of dim 128, QK RMSNorm, sequence 8192, 4.2M-token batches, 1T tokens,
# peak LR 4.78e-4, 5% linear warm-up, cosine to 10%, Adam 0.9 / 0.95, weight decay 0.1, clip 1.0.
# Layers (24), hidden size (1408), expert width (416) and vocabulary (Llama-3, 128256, untied) are
# not in the paper: ours, a guess chosen to land on 6.1B / 1.01B (examples/README.md;
# mea-model-size). The paper's counts of its smaller models (Tables 3 and 5) fit about 157K
# embedding rows counted once (a tied ~157K or an untied ~78.6K vocabulary); with those and no
# shared expert, 18 layers, hidden 2048, experts of 384 give 6.1B / 1.01B (tests/
# test_paper_numbers.py). This shape with a 78.6K untied vocabulary has 5.93B / 0.87B.
#
#   VARIANT=baseline|kha-mlp|mea   standard attention, KHA-MLP on V (the paper's MoE setting),
#                                  or MEA (MEA_NC component KV heads, default 4 = no compression)
#   TP, PP, EP, MBS                parallel sizes and micro-batch (defaults 1, 1, 8, 1)
#   DATA_PATH, TOKENIZER_MODEL     Megatron-LM indexed data prefix(es) and HF tokenizer; without
#                                  DATA_PATH the run uses --mock-data
#   CHECKPOINT_DIR, TRAIN_TOKENS   default ./checkpoints/kha_moe_6b_a1b_$VARIANT, 1e12
# plus the launch settings of common.sh (LAUNCH, NNODES, PRECISION, DRY_RUN, ...). Examples:
#   DRY_RUN=1 VARIANT=kha-mlp LAUNCH=slurm NNODES=16 bash kha_moe_6b_a1b.sh
#   MEGATRON_LM_DIR=~/Megatron-LM VARIANT=mea PRECISION=fp8 bash kha_moe_6b_a1b.sh
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"
SCRIPT="$MEA_EXAMPLES_DIR/$(basename "${BASH_SOURCE[0]}")"

VARIANT=${VARIANT:-baseline}
TP=${TP:-1}
PP=${PP:-1}
EP=${EP:-8}
MBS=${MBS:-1}
SEQ_LENGTH=8192
GLOBAL_BATCH=512                       # 512 x 8192 = 4,194,304 tokens per step
TRAIN_TOKENS=${TRAIN_TOKENS:-1000000000000}
TRAIN_ITERS=$((TRAIN_TOKENS / (GLOBAL_BATCH * SEQ_LENGTH)))
CHECKPOINT_DIR=${CHECKPOINT_DIR:-./checkpoints/kha_moe_6b_a1b_$VARIANT}

MODEL_ARGS=(
    --num-layers 24
    --hidden-size 1408
    --ffn-hidden-size 5632              # unused: every layer is MoE (--moe-layer-freq 1)
    --num-attention-heads 32
    --group-query-attention
    --num-query-groups 4
    --kv-channels 128
    --qk-layernorm
    --normalization RMSNorm
    --norm-epsilon 1e-6
    --swiglu
    --disable-bias-linear
    --position-embedding-type rope
    --rotary-base 500000
    --untie-embeddings-and-output-weights
    --seq-length "$SEQ_LENGTH"
    --max-position-embeddings "$SEQ_LENGTH"
    --attention-dropout 0.0
    --hidden-dropout 0.0
    --init-method-std 0.02
)

# Aux-loss-free balancing (DeepSeek-V3): a per-expert bias on the sigmoid router scores, nudged
# toward balance every step, and no auxiliary loss.
MOE_ARGS=(
    --num-experts 128
    --moe-router-topk 8
    --moe-ffn-hidden-size 416
    --moe-layer-freq 1
    --moe-router-score-function sigmoid
    --moe-router-enable-expert-bias
    --moe-router-bias-update-rate 1e-3
    --moe-router-load-balancing-type none
    --moe-router-dtype fp32
    --moe-grouped-gemm
    --moe-token-dispatcher-type alltoall
    --moe-permute-fusion
)

case "$VARIANT" in
    baseline) ATTENTION_ARGS=(--attention-variant standard) ;;
    kha-mlp) ATTENTION_ARGS=(--attention-variant kha --kha-variant mlp --kha-targets v) ;;
    mea) ATTENTION_ARGS=(--attention-variant mea --mea-num-kv-components "${MEA_NC:-4}"
                         --mea-head-norm) ;;
    *) echo "VARIANT must be baseline, kha-mlp or mea (got '$VARIANT')" >&2; exit 2 ;;
esac

TRAINING_ARGS=(
    --micro-batch-size "$MBS"
    --global-batch-size "$GLOBAL_BATCH"
    --train-iters "$TRAIN_ITERS"
    --lr 4.78e-4
    --min-lr 4.78e-5
    --lr-decay-style cosine
    --lr-decay-iters "$TRAIN_ITERS"
    --lr-warmup-fraction 0.05
    --optimizer adam
    --adam-beta1 0.9
    --adam-beta2 0.95
    --adam-eps 1e-8
    --weight-decay 0.1
    --clip-grad 1.0
    --use-distributed-optimizer
    --overlap-grad-reduce
    --overlap-param-gather
    --cross-entropy-loss-fusion
    --manual-gc
    --manual-gc-interval 10
)

PARALLEL_ARGS=(
    --tensor-model-parallel-size "$TP"
    --pipeline-model-parallel-size "$PP"
    --expert-model-parallel-size "$EP"
    --expert-tensor-parallel-size 1
)
if ((TP > 1)); then
    PARALLEL_ARGS+=(--sequence-parallel)   # Megatron requires SP for MoE with TP
fi

precision_args
if [[ "$PRECISION" == fp8 ]]; then
    PRECISION_ARGS+=(--moe-router-padding-for-fp8)   # FP8 grouped GEMMs need padded token counts
fi

if [[ -n "${DATA_PATH:-}" ]]; then
    DATA_ARGS=(--data-path $DATA_PATH --split 99,1,0
        --tokenizer-type HuggingFaceTokenizer
        --tokenizer-model "${TOKENIZER_MODEL:-meta-llama/Llama-3.2-1B}")
else
    # NullTokenizer adds one EOD id: 128255 + 1 = the Llama-3 vocabulary, so sizes match real data.
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size 128255)
fi

CHECKPOINT_ARGS=(
    --save "$CHECKPOINT_DIR"
    --load "$CHECKPOINT_DIR"
    --save-interval 1000
    --ckpt-format torch_dist
)

LOGGING_ARGS=(
    --log-interval 10
    --log-throughput
    --eval-interval 1000
    --eval-iters 10
    --tensorboard-dir "$CHECKPOINT_DIR/tensorboard"
)

launch "$SCRIPT" \
    "${MODEL_ARGS[@]}" "${MOE_ARGS[@]}" "${ATTENTION_ARGS[@]}" "${TRAINING_ARGS[@]}" \
    "${PARALLEL_ARGS[@]}" "${PRECISION_ARGS[@]}" "${DATA_ARGS[@]}" "${CHECKPOINT_ARGS[@]}" \
    "${LOGGING_ARGS[@]}"
