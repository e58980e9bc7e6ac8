#!/usr/bin/env bash
# mea-bench-attention prepared for one GPU (an H200): bf16, Transformer Engine's spec when TE
# imports, hidden 2048 and 4096 at sequence 4096. Prints the ratio of every variant to the
# baseline and the layer's TFLOP/s (model FLOPs of the baseline layer, causal attention halved).
# Finishes in a few minutes; the collective byte counts are a CPU matter (gloo,
# mea-bench-attention without --device) and are skipped here.
#
#   bash tools/bench_gpu.sh [OUT_DIR]          # default: $OUT if set, else runs/bench_gpu
#
# On a bare machine with torch but without megatron-core, carry wheels in .whl/ (the script
# installs whatever is there into /tmp/site first), e.g. from a machine with pip and network:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#       --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 -d .whl \
#       megatron-core==0.16.1 nvidia-ml-py psutil tqdm
set -euo pipefail
cd "$(dirname "$0")/.."

if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl
    export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1
OUT_DIR="${1:-${OUT:-runs/bench_gpu}}"
mkdir -p "$OUT_DIR"

python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print('[bench_gpu]', torch.__version__, torch.cuda.get_device_name())"
TE=()
if python3 -c "import transformer_engine.pytorch" 2>/dev/null; then
    TE=(--transformer-engine)
    echo "[bench_gpu] Transformer Engine found: TE spec (TEDotProductAttention, TE linears)"
else
    echo "[bench_gpu] no Transformer Engine: local spec (unfused softmax attention)"
fi

COMMON=(--device cuda --bf16 "${TE[@]}" --seq-length 4096 --micro-batch-size 1
        --repeats 30 --warmup 5 --model-layers 2 --model-micro-batches 2 --model-repeats 20
        --vocab-size 32768
        --tp-sizes)
# The console script when megatron_mea is installed; else the same module from this checkout.
BENCH=(mea-bench-attention)
command -v mea-bench-attention >/dev/null || BENCH=(python3 -m megatron_mea.cli.bench_attention)
"${BENCH[@]}" "${COMMON[@]}" --hidden-size 2048 --num-attention-heads 16 \
    --num-query-groups 4 --json "$OUT_DIR/bench_gpu_h2048.json"
"${BENCH[@]}" "${COMMON[@]}" --hidden-size 4096 --num-attention-heads 32 \
    --num-query-groups 8 --json "$OUT_DIR/bench_gpu_h4096.json"
echo "[bench_gpu] JSON in $OUT_DIR"
