"""`mea-demo` (`make demo`): pretrain a small MoE GPT with MEA, KHA and the baseline on CPU.

1. Build a corpus from the Python standard library's source and documentation on this machine.
2. Preprocess it into Megatron `.bin/.idx` files with the built-in byte-level tokenizer.
3. Run `mea-pretrain` (a subprocess each, the real CLI) for every variant: same data, same seed.
   `mea-vh` is MEA with virtual heads: 2 cached K/V component heads for the 4 groups.
4. Greedy-decode a short sample from each checkpoint with `mea-generate` (the real CLI).
5. Print a summary table (losses, throughput, KV-cache bytes per token, the sample) and save a
   loss-curve PNG.

Run again in the same `--out`, it keeps the variants that are complete, continues the ones an
interruption left halfway and starts the others afresh (`megatron_mea.apps.demo.runs`). The
console shows a progress bar and one line per stage, and the table; the tools' own output is
appended to `<out>/demo.log`, Megatron-Core's log records to
`<out>/runs/<variant>/mea-pretrain.log`.

    mea-demo [--out runs/demo] [--train-iters 300] [--variants mea-vh kha]
"""

import os
import sys
import time

from megatron_mea.apps.configs import DEMO
from megatron_mea.apps.demo.pipeline import LOG, PLOT, VARIANTS, run_demo
from megatron_mea.apps.demo.runs import DemoError
from megatron_mea.runtime.argparsing import ArgumentParser
from megatron_mea.runtime.console import print_progress


def main(argv=None) -> int:
    """Run the whole demo: data, one training run per variant, the table and the plot.

    Args:
        argv: the arguments. Default: `sys.argv[1:]`.

    Returns:
        The exit status: 0; 1 when a tool it ran failed (one line naming it and the log);
        130 interrupted (a rerun continues).
    """
    parser = ArgumentParser(prog="mea-demo", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="runs/demo")
    parser.add_argument("--train-iters", type=int, default=DEMO["train_iters"])
    parser.add_argument("--save-interval", type=int, default=DEMO["save_interval"],
                        help="checkpoint every N steps: where an interrupted demo continues "
                             "from. Default: %(default)s")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--corpus-bytes", type=int, default=8 * 2**20)
    args = parser.parse_args(argv)

    print_progress("megatron_mea.apps.corpus", "megatron_mea.apps.demo")
    start = time.perf_counter()
    try:
        table = run_demo(args, " ".join(sys.argv[1:] if argv is None else argv))
    except DemoError as exc:
        print(f"mea-demo: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("mea-demo: interrupted; run it again to continue where it stopped",
              file=sys.stderr)
        return 130
    print("\n" + table + "\n")
    print(f"[demo] loss curves: {os.path.join(args.out, PLOT)}; TensorBoard: "
          f"{os.path.join(args.out, 'tensorboard')}")
    print(f"[demo] logs: {os.path.join(args.out, LOG)} (the tools' output); Megatron-Core's "
          f"records: {os.path.join(args.out, 'runs', '<variant>', 'mea-pretrain.log')}")
    print(f"[demo] total {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
