# Shared launch logic for the megatron_mea Megatron-LM examples. Sourced, not run.
#
# Environment (all optional):
#   LAUNCH          single (default: torchrun on this node) | multi (torchrun, one call per node)
#                   | slurm (sbatch from a login node; srun + torchrun inside the allocation)
#   GPUS_PER_NODE   default 8
#   NNODES          default 1 for single, required for multi/slurm
#   NODE_RANK, MASTER_ADDR, MASTER_PORT   multi only (MASTER_PORT default 6000)
#   PRECISION       bf16 (default) | fp8 (E4M3, blockwise scaling: Hopper's FP8 recipe)
#   DRY_RUN=1       validate every argument (no GPU, no Megatron-LM) and print the launch command
#   CPU_SMOKE=1     with DRY_RUN=1: then also run pretrain_gpt_mea.py for 3 steps on CPU at a tiny
#                   shape with this recipe's attention variant (and a tiny MoE if it has one),
#                   through `python -m megatron_mea.cpu` (needs MEGATRON_LM_DIR; SMOKE_TP=2 for TP+SP)
#   MEGATRON_LM_TAG Megatron-LM tag the dry run validates against, core_v0.16.1 or core_v0.19.0
#                   (default: the one matching the installed megatron-core: 0.16.x or >= 0.17)
#   MEGATRON_LM_DIR Megatron-LM checkout at tag core_v0.16.1 (megatron-core 0.16.x) or
#                   core_v0.19.0 (megatron-core 0.19.x), put on PYTHONPATH
#   SBATCH_ARGS     extra sbatch options (account, partition, time), e.g. "-A proj -p batch"
#   PYTHON          python for the dry run (default python3)

MEA_EXAMPLES_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
MEA_REPO_DIR=$(cd "$MEA_EXAMPLES_DIR/../.." && pwd)
ENTRY="$MEA_EXAMPLES_DIR/pretrain_gpt_mea.py"

LAUNCH=${LAUNCH:-single}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
PRECISION=${PRECISION:-bf16}
DRY_RUN=${DRY_RUN:-0}
PYTHON=${PYTHON:-python3}
case "$LAUNCH" in
    single) NNODES=${NNODES:-1} ;;
    multi | slurm) NNODES=${NNODES:-${SLURM_NNODES:-}} ;;
    *) echo "LAUNCH must be single, multi or slurm (got '$LAUNCH')" >&2; exit 2 ;;
esac
if [[ -z "$NNODES" ]]; then
    echo "LAUNCH=$LAUNCH needs NNODES" >&2
    exit 2
fi
WORLD_SIZE=$((NNODES * GPUS_PER_NODE))

# precision_args: the BF16 or FP8 switch. FP8 keeps BF16 master/activation dtypes and runs the
# TE linears (qkv, proj, experts) in E4M3 with 1x128/128x128 block scales (TE >= 2.3, Hopper);
# the plugin's small ops stay in BF16 (see docs/decisions.md, "Precision and FP8").
precision_args() {
    case "$PRECISION" in
        bf16) PRECISION_ARGS=(--bf16) ;;
        fp8) PRECISION_ARGS=(--bf16 --fp8-format e4m3 --fp8-recipe blockwise) ;;
        *) echo "PRECISION must be bf16 or fp8 (got '$PRECISION')" >&2; exit 2 ;;
    esac
}

# nccl_env: settings Megatron needs on every launch form, plus the usual InfiniBand knobs.
# Cluster-specific ones (NCCL_SOCKET_IFNAME, NCCL_IB_HCA) are left to the caller's environment.
nccl_env() {
    # Megatron's TP/SP communication overlap relies on a single hardware queue per device.
    export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
    export TORCH_NCCL_ASYNC_ERROR_HANDLING=${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}
    export TORCH_NCCL_AVOID_RECORD_STREAMS=${TORCH_NCCL_AVOID_RECORD_STREAMS:-1}
    export NCCL_IB_TIMEOUT=${NCCL_IB_TIMEOUT:-19}
    export NCCL_IB_SL=${NCCL_IB_SL:-1}
    export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
    export PYTHONPATH="${MEGATRON_LM_DIR:+$MEGATRON_LM_DIR:}$MEA_REPO_DIR${PYTHONPATH:+:$PYTHONPATH}"
}

# launch SCRIPT ARGS...: run (or, with DRY_RUN=1, validate) pretrain_gpt_mea.py with ARGS.
launch() {
    local script=$1
    shift
    local -a torchrun_args
    case "$LAUNCH" in
        single) torchrun_args=(--standalone --nnodes 1 --nproc-per-node "$GPUS_PER_NODE") ;;
        multi)
            if [[ "$DRY_RUN" == 1 ]]; then
                NODE_RANK=${NODE_RANK:-0}
                MASTER_ADDR=${MASTER_ADDR:-localhost}
            fi
            torchrun_args=(--nnodes "$NNODES" --node-rank "${NODE_RANK:?LAUNCH=multi needs NODE_RANK}"
                --nproc-per-node "$GPUS_PER_NODE"
                --master-addr "${MASTER_ADDR:?LAUNCH=multi needs MASTER_ADDR}"
                --master-port "${MASTER_PORT:-6000}") ;;
        slurm)
            # Inside the allocation every node runs one torchrun; node 0 hosts the rendezvous.
            torchrun_args=(--nnodes "$NNODES" --node-rank '$SLURM_NODEID'
                --nproc-per-node "$GPUS_PER_NODE" --master-addr '$MASTER_ADDR'
                --master-port "${MASTER_PORT:-6000}") ;;
    esac
    nccl_env
    if [[ "$DRY_RUN" == 1 ]]; then
        echo "launch ($LAUNCH, $NNODES node(s) x $GPUS_PER_NODE GPUs):"
        echo "  torchrun ${torchrun_args[*]} $ENTRY $*"
        "$PYTHON" -m megatron_mea.cli.dry_run --world-size "$WORLD_SIZE" \
            ${MEGATRON_LM_TAG:+--megatron-lm-tag "$MEGATRON_LM_TAG"} -- "$@"
        if [[ "${CPU_SMOKE:-0}" == 1 ]]; then
            cpu_smoke
        fi
        return
    fi
    case "$LAUNCH" in
        single | multi) exec torchrun "${torchrun_args[@]}" "$ENTRY" "$@" ;;
        slurm)
            if [[ -z "${SLURM_JOB_ID:-}" ]]; then
                # From a login node: submit this same script; it comes back here inside the job.
                # shellcheck disable=SC2086
                exec sbatch --nodes "$NNODES" --ntasks-per-node 1 --gpus-per-node "$GPUS_PER_NODE" \
                    --exclusive --job-name "$(basename "$script" .sh)" $SBATCH_ARGS \
                    --export ALL --wrap "bash $(printf '%q' "$script")"
            fi
            MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
            export MASTER_ADDR
            local cmd
            cmd="torchrun ${torchrun_args[*]} $(printf '%q ' "$ENTRY" "$@")"
            exec srun --nodes "$NNODES" --ntasks-per-node 1 --kill-on-bad-exit=1 bash -c "$cmd" ;;
    esac
}

# cpu_smoke: the real entry script, 3 steps on CPU (gloo) at a tiny shape, with the caller's
# ATTENTION_ARGS and, when it defines MOE_ARGS, a tiny MoE in every layer.
cpu_smoke() {
    if [[ -z "${MEGATRON_LM_DIR:-}" ]]; then
        echo "CPU_SMOKE=1 needs MEGATRON_LM_DIR (a Megatron-LM checkout at the tag of the installed megatron-core)" >&2
        exit 2
    fi
    local tp=${SMOKE_TP:-1}
    local -a smoke_args=(
        --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 8
        --group-query-attention --num-query-groups 8 --seq-length 32 --max-position-embeddings 32
        --position-embedding-type rope --normalization RMSNorm --swiglu --disable-bias-linear
        --attention-dropout 0 --hidden-dropout 0 --micro-batch-size 2 --global-batch-size 4
        --train-iters 3 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer --vocab-size 255
        --transformer-impl local --use-cpu-initialization --distributed-backend gloo
        --no-gradient-accumulation-fusion --no-rope-fusion --no-persist-layer-norm
        --no-masked-softmax-fusion --no-bias-swiglu-fusion --log-interval 1 --eval-iters 0
        --eval-interval 1000 --tensor-model-parallel-size "$tp" "${ATTENTION_ARGS[@]}"
    )
    if ((tp > 1)); then
        smoke_args+=(--sequence-parallel)
    fi
    if [[ -n "${MOE_ARGS+set}" ]]; then
        smoke_args+=(--num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 64
            --moe-layer-freq 1 --moe-token-dispatcher-type alltoall)
    fi
    echo "CPU smoke: torchrun --standalone --nproc-per-node $tp -m megatron_mea.cpu $ENTRY ${smoke_args[*]}"
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$tp" \
        -m megatron_mea.cpu "$ENTRY" "${smoke_args[@]}"
    echo "CPU SMOKE OK"
}
