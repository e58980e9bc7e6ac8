#!/usr/bin/env bash
# The GPU acceptance run on a bare GPU machine (torch with CUDA; no network; pip not needed):
# install what the machine lacks from the wheels carried in wheels/ (`make gpu-wheels` fills it
# on a machine with network), then run `python -m megatron_mea.cli.gpu_acceptance` from this
# checkout. The report lands in $OUT (or --out) as at most four files.
#
#   bash scripts/gpu_acceptance.sh [--out DIR] [other mea-gpu-acceptance flags]
#   PYTHON=/path/to/python bash scripts/gpu_acceptance.sh      # another interpreter
#   MEA_WHEELS=DIR MEA_SITE=DIR ...                             # other wheel / install folders
#
# Wheels are unpacked (no pip) into a private folder ($MEA_SITE, default /tmp/mea-site) put on
# PYTHONPATH after this checkout, so the machine's own site-packages are never modified.
# megatron-core and megatron_mea always come from wheels/ (the tested versions); any other wheel
# only when its distribution is not installed (the machine's numpy, pytest... are kept).
# Transformer Engine is never installed: it is used only if it already imports. See docs/gpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
# This checkout first: its megatron_mea and tests/ are what is checked.
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1

WHEELS="${MEA_WHEELS:-wheels}"
if compgen -G "$WHEELS/*.whl" >/dev/null; then
    SITE="${MEA_SITE:-/tmp/mea-site}"
    "$PYTHON" -m megatron_mea.apps.acceptance.install "$WHEELS" "$SITE"
    export PYTHONPATH="$PWD:$SITE${PYTHONPATH#"$PWD"}" PATH="$SITE/bin:$PATH"
else
    echo "[gpu_acceptance.sh] no wheels in $WHEELS (make gpu-wheels): using what is installed"
fi
exec "$PYTHON" -m megatron_mea.cli.gpu_acceptance "$@"
