"""Benchmark MEA and KHA against the baseline: layer and model-step time ratios, and the bytes of
every collective at TP=2 and TP=4 checked against SPEC section 3 (see
`megatron_mea.cli.bench_attention` for the flags).

    python tools/bench_attention.py                  # CPU: hidden 1024, 16/4 heads, seq 2048
    bash tools/bench_gpu.sh                          # one GPU: bf16, hidden 2048 and 4096
"""

import os
import sys

# Run from a checkout without installing: the repository root holds the package.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_mea.cli.bench_attention import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
