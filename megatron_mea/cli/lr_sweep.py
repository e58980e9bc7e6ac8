"""`mea-lr-sweep`: LR robustness sweep: baseline, the head norm alone (+norm), HLC alone (MEA
without head norm), MEA (HLC + norm), KHA-Linear and KHA-MLP over a grid of peak learning rates,
same seed and data order, each run through `mea-pretrain`.

    mea-lr-sweep --preset cpu                     # ~47 min on 2 cores, stdlib corpus
    mea-lr-sweep --preset gpu --data-path data/my_corpus \\
        --set tokenizer_type=HuggingFaceTokenizer --set tokenizer_model=/path/to/tokenizer
    mea-lr-sweep --out runs/lr_sweep_cpu --summary-only --spike-threshold 0.3

Rerunning the same command continues an interrupted sweep: finished runs are kept, an
interrupted run resumes from its last checkpoint. Outputs in --out: summary.txt and summary.json
(the table), loss_vs_step.png (one panel per LR), final_loss_vs_lr.png, runs/<variant>/lr<lr>/
(checkpoints, metrics.jsonl, train.log). The definitions of spike, divergence and largest stable
LR are in `megatron_mea.apps.sweeps.sweep` and at the foot of the table; the sweep itself is
`megatron_mea.apps.sweeps.lr_sweep`.

Beside each run's verdict, the MEA paper's loss law `L(D) = (D_c / D)^alpha + L0` (its App. D)
fitted to the run's losses after warm-up, where the run has at least --fit-min-steps of them:
the fitted `L0` and the loss it predicts at --predict-tokens (`megatron_mea.apps.sweeps.fit`;
summary.json holds each run's fit under "fit").
"""

import sys

from megatron_mea.apps.sweeps.lr_sweep import FAILURES, build_parser, failure, run
from megatron_mea.runtime.console import print_progress


def main(argv=None) -> int:
    """Run (or continue) the sweep, then print and save the table and plots.

    Args:
        argv: the arguments. Default: `sys.argv[1:]`.

    Returns:
        The exit status: 0; 1 a run failed or there is no run to judge; 2 a refused setting.
    """
    args = build_parser().parse_args(argv)
    print_progress("megatron_mea.apps.corpus", "megatron_mea.apps.sweeps")
    try:
        run(args)
    except FAILURES as exc:
        status, line = failure(exc)
        print(line, file=sys.stderr)
        return status
    return 0


if __name__ == "__main__":
    sys.exit(main())
