"""`mea-soak`: soak test (not in CI): multi-process training killed at random moments and resumed.

Each episode trains a small MoE GPT with MEA for `--iters` steps twice on `--world-size` processes
(torchrun, gloo on CPU): once uninterrupted (the reference), once under fire: the whole process
group is SIGKILLed after a random delay, then relaunched with `--load`, until the run finishes.
The episode passes when every iteration 1..N has a loss in the killed run's metrics (nothing lost)
and each equals the reference bit for bit (no step repeated or skipped: data position, optimizer,
RNG and weights all resumed exactly), and no helper process of a killed trainer outlives it.
Episodes repeat until `--minutes` have passed.

    mea-soak --minutes 20 --world-size 2
"""

import sys

from megatron_mea.apps.soak import run
from megatron_mea.runtime.argparsing import ArgumentParser
from megatron_mea.runtime.console import print_progress


def main(argv=None) -> int:
    """Run episodes until the time budget is spent.

    Args:
        argv: the arguments. Default: `sys.argv[1:]`.

    Returns:
        The exit status: 0 every episode passed, 1 a step was lost or differed (logs kept).
    """
    parser = ArgumentParser(prog="mea-soak", description=__doc__.splitlines()[0])
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--iters", type=int, default=60)
    parser.add_argument("--save-interval", type=int, default=7)
    parser.add_argument("--kill-min", type=float, default=8.0, help="seconds")
    parser.add_argument("--kill-max", type=float, default=25.0, help="seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--parallel", nargs="*", default=["--tensor-model-parallel-size", "2",
                                                          "--sequence-parallel"])
    args = parser.parse_args(argv)
    print_progress("megatron_mea.apps.soak")
    return 1 if run(args) else 0


if __name__ == "__main__":
    sys.exit(main())
