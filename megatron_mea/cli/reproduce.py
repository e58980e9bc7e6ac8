"""`mea-reproduce`: the papers' headline claims re-run at demo scale, with a markdown report.

    mea-reproduce                                  # both studies: 24 runs, ~45 min on 2 cores
    mea-reproduce --studies kha --out runs/reproduce_kha
    mea-reproduce --report-dir docs/reproduction   # the report and its plots there

Two studies, each a set of `mea-lr-sweep` grids (its `cpu` preset: the demo's MoE GPT on the
stdlib corpus, 240 steps per run), one grid per seed:
- `mea-lr`: the MEA paper's LR study (Section 5.1.2, Appendix E): the baseline, the head norm
  alone (+norm) and MEA at peak LR 1e-4, 5e-4, 1e-3 and 3e-3, linear warm-up over 40 % of the
  steps (the paper's 1,000 of 2,500), then constant. The paper: MEA stays stable at 3e-3 where
  the others do not, and has the lowest loss at its best LR.
- `kha`: the KHA comparison (Sections 4.3-4.4, Figs. 1-2): the baseline, KHA-Linear (q, k, v)
  and KHA-MLP (v) with QK RMSNorm (the paper's Qwen3-style layer), 5 % warm-up and cosine to
  10 % (its schedule), at two LRs and two seeds. The paper: lower loss and fewer loss spikes.

Rerunning continues: finished runs are kept (`mea-lr-sweep`'s resumption). The report
(`report.md`) has one table per study, what the paper claims beside what the runs show, and the
sweeps' plots (loss against step per LR, final loss against LR per variant) copied beside it.
"""

import argparse
import os
import sys

from megatron_mea.apps.sweeps.lr_sweep import FAILURES, failure
from megatron_mea.apps.sweeps.reproduce import STUDIES, run
from megatron_mea.runtime.argparsing import ArgumentParser
from megatron_mea.runtime.console import print_progress


def build_parser() -> argparse.ArgumentParser:
    """The command-line flags."""
    parser = ArgumentParser(
        prog="mea-reproduce", description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join("runs", "reproduce"),
                        help="runs and data. Default: runs/reproduce")
    parser.add_argument("--report-dir",
                        help="where report.md and its plots go. Default: --out")
    parser.add_argument("--studies", nargs="+", choices=list(STUDIES), default=list(STUDIES),
                        help="Default: all")
    parser.add_argument("--data-path", nargs="+",
                        help="preprocessed dataset. Default: the demo's stdlib corpus")
    parser.add_argument("--train-iters", type=int, help="steps per run. Default: the preset's")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="any mea-pretrain setting for every run (as mea-lr-sweep's --set)")
    parser.add_argument("--smoke", action="store_true",
                        help="a check of the pipeline, not a result: one run per study (its "
                             "last variant, MEA or KHA-MLP, at the first LR and seed)")
    return parser


def main(argv=None) -> int:
    """Run (or continue) the studies, then write the report.

    Args:
        argv: the arguments. Default: `sys.argv[1:]`.

    Returns:
        The exit status: 0, or `mea-lr-sweep`'s when a sweep stopped short (its one line said
        why).
    """
    args = build_parser().parse_args(argv)
    print_progress("megatron_mea.apps.corpus", "megatron_mea.apps.sweeps")
    try:
        path = run(args)
    except FAILURES as exc:
        status, line = failure(exc)
        print(line, file=sys.stderr)
        return status
    print(f"[reproduce] report: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
