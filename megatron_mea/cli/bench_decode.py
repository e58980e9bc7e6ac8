"""`mea-bench-decode`: decode tokens/s and KV-cache bytes of MEA / KHA against the baseline.

Builds randomly initialised models of one shape that differ only in the attention variant, fills
a static KV cache with a prompt of each context length and times greedy decoding after it
(`megatron_mea.inference.generate`). Not a test: numbers depend on the machine.

    mea-bench-decode                                               # CPU-sized defaults
    mea-bench-decode --num-layers 16 --hidden-size 2048 --num-attention-heads 16 \
        --num-query-groups 8 --context-lengths 1024 4096 16384 --batch-size 8 --bf16   # a GPU
    torchrun --nproc-per-node 2 --no-python mea-bench-decode --tp 2

Variants: `baseline` (GQA with ng groups), `mea` (nc = ng), `mea-half` (nc = ng/2: the cache is
half the baseline's K/V plus one scalar per composite head and token with qk_layernorm; decoding
attends over the cached components directly), `kha` (linear). "vs base" compares with the first
variant listed (the baseline by default), measured in the same run. `--json FILE` writes the
table (KV bytes, decode tokens/s and both ratios per context length and variant).
"""

import argparse
import os
import sys

from megatron_mea.apps.bench.decode import VARIANTS, run
from megatron_mea.cpu import megatron_on_cpu
from megatron_mea.runtime.argparsing import ArgumentParser
from megatron_mea.runtime.console import print_progress


def build_parser() -> argparse.ArgumentParser:
    """Flags: the model shape, the variants, the context lengths."""
    parser = ArgumentParser(
        prog="mea-bench-decode", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--num-layers", type=int, default=4)
    parser.add_argument("--hidden-size", type=int, default=256)
    parser.add_argument("--num-attention-heads", type=int, default=8)
    parser.add_argument("--num-query-groups", type=int, default=4)
    parser.add_argument("--kv-channels", type=int, default=None)
    parser.add_argument("--vocab-size", type=int, default=1024)
    parser.add_argument("--num-experts", type=int, default=None, help="MoE layers. Default: dense")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--context-lengths", type=int, nargs="+", default=[512, 2048, 8192])
    parser.add_argument("--new-tokens", type=int, default=32, help="decoded tokens per row")
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3, help="timed runs; the best is kept")
    parser.add_argument("--tp", type=int, default=int(os.environ.get("WORLD_SIZE", "1")))
    parser.add_argument("--bf16", action="store_true")
    parser.add_argument("--threads", type=int, help="torch CPU threads. Default: torch's choice")
    parser.add_argument("--qk-layernorm", action=argparse.BooleanOptionalAction, default=True,
                        help="RMS-normalise q and k per head. Default: on")
    parser.add_argument("--json", metavar="FILE", help="also write the results as JSON to FILE")
    return parser


@megatron_on_cpu()
def main(argv=None) -> int:
    """Run the grid and print one line per (context length, variant).

    Args:
        argv: the arguments. Default: `sys.argv[1:]`.

    Returns:
        The exit status (0; argparse exits with 2 on usage errors).
    """
    opts = build_parser().parse_args(argv)
    print_progress("megatron_mea.apps.bench.decode")
    run(opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
