"""`mea-bench-attention`: the cost of MEA and KHA against the baseline, per layer and model step.

1. Time: forward + backward of one transformer layer, and one step of a small full GPT (micro-
   batches, fold flush, Adam), for every variant in one process. Rounds run the variants in a
   shuffled order; the ratio to the baseline is the median over rounds of the paired ratio
   (same round, so the machine's drift cancels). Not a test: numbers depend on the machine.
   The local spec is timed with each `--core-attention` (default both: Megatron's unfused
   `DotProductAttention`, whose score tensors dominate a CPU step, and torch's fused
   `scaled_dot_product_attention`), each against its own baseline; the JSON has them under
   `by_core_attention`, and `layer` / `model_step` repeat the first.
2. Bytes: every collective of one layer's forward + backward at TP=2 and TP=4 (sequence parallel,
   real gloo processes), counted by wrapping `torch.distributed`
   (`megatron_mea.parallel.comm_counter`), and the extra over the baseline checked against the
   formulas of `megatron_mea.parallel.exchange`; exit status 1 if they differ.

    mea-bench-attention                  # CPU: hidden 1024, 16/4 heads, seq 2048
    mea-bench-attention --device cuda --bf16 --hidden-size 4096 \\
        --num-attention-heads 32 --num-query-groups 8 --seq-length 4096   # one GPU

Prints a table; `--json` writes every number. `--profile` prints torch.profiler's top ops for
one layer step of each variant.
"""

import argparse
import json
import sys

from megatron_mea.apps.bench import attention
from megatron_mea.apps.bench.steps import SHAPE, VARIANTS
from megatron_mea.cpu import megatron_on_cpu
from megatron_mea.runtime.argparsing import ArgumentParser
from megatron_mea.runtime.console import print_progress


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags: the shape, the rounds, the device, the TP sizes counted."""
    parser = ArgumentParser(prog="mea-bench-attention", description=__doc__.splitlines()[0])
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS),
                        help="baseline is always included (ratios are to it)")
    for name, default in SHAPE.items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default,
                            help="default 4 * hidden" if default is None else None)
    parser.add_argument("--micro-batch-size", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=15, help="timed rounds of every variant")
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first")
    parser.add_argument("--model-layers", type=int, default=2,
                        help="layers of the full-model step (0 skips it)")
    parser.add_argument("--model-micro-batches", type=int, default=2)
    parser.add_argument("--model-repeats", type=int, default=7,
                        help="timed rounds of the model step")
    parser.add_argument("--tp-sizes", type=int, nargs="*", default=[2, 4],
                        help="TP sizes whose collectives are counted (none: skip)")
    parser.add_argument("--bytes-seq-length", type=int, default=None,
                        help="sequence length of the byte count (default --seq-length)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--bf16", action="store_true", help="bf16 params and activations")
    parser.add_argument("--transformer-engine", action="store_true",
                        help="TE spec (TEDotProductAttention etc.); needs megatron_mea[te]")
    parser.add_argument("--core-attention", nargs="+", default=["megatron", "sdpa"],
                        choices=["megatron", "sdpa"],
                        help="core attention(s) of the local spec, each timed against its own "
                             "baseline: megatron (unfused DotProductAttention), sdpa (torch's "
                             "scaled_dot_product_attention); the TE spec always uses TE's")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--json", default=None, help="write all results to this file")
    parser.add_argument("--seed", type=int, default=1234)
    return parser


@megatron_on_cpu()
def main(argv=None) -> int:
    """Time the variants, count their collectives, print the table.

    Args:
        argv: the arguments. Default: `sys.argv[1:]`.

    Returns:
        The exit status: 0, or 1 when a counted collective differs from its formula.
    """
    args = build_parser().parse_args(argv)
    import torch

    from megatron_mea._optional import require

    if args.transformer_engine:
        require("transformer_engine", "--transformer-engine")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: no CUDA device is visible")
    if args.threads:
        torch.set_num_threads(args.threads)
    if "baseline" not in args.variants:
        args.variants = ["baseline", *args.variants]
    print_progress(attention.__name__)
    result = attention.run(args)
    print("\n" + attention.report(result))
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(result, handle, indent=1)
        print(f"\n[bench] wrote {args.json}")
    mismatched = attention.mismatches(result)
    if mismatched:
        print(f"[bench] collective bytes differ from the formulas: {mismatched}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
