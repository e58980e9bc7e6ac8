"""`mea-pretrain`: Megatron-Core pretraining with MEA / KHA.

Launch plainly for one process, or with torchrun on one or many nodes (NCCL on GPUs, gloo on
CPU):

    mea-pretrain --config run.yaml
    torchrun --nproc-per-node 2 --no-python mea-pretrain --config run.yaml \\
        --tensor-model-parallel-size 2

The console shows the progress bar, the per-interval metrics, warnings and errors; every log
record from INFO (Megatron-Core's config dumps, gradient buckets, dataset builder) is appended to
`<--save>/mea-pretrain.log` (rank 0).
"""

import sys

from megatron_mea.runtime.console import configure_console
from megatron_mea.cpu import megatron_on_cpu


@megatron_on_cpu()
def main(argv=None) -> int:
    """Parse and validate the arguments (before anything starts), then train.

    Args:
        argv: the arguments. Default: `sys.argv[1:]`.

    Returns:
        The exit status: 0 trained; 2 an input refused before training (a flag, a file, a
        directory or a checkpoint; one line); 1 a failure at run time (a non-finite loss under
        the `stop` policy, a collective that timed out, a checkpoint or metrics.jsonl that
        could not be written, one line naming the last checkpoint; anything unexpected, with
        its traceback); 128 + N stopped by signal N after saving a checkpoint
        (`--exit-signal-handler`: 143 SIGTERM, 130 SIGINT, 129 SIGHUP; one line naming it).
    """
    # Megatron-Core's INFO records go to the run's log file (`--save`/mea-pretrain.log) only.
    configure_console("%(asctime)s %(levelname)s %(name)s: %(message)s")
    from megatron_mea.apps.training.arguments import parse_run

    try:
        args, config = parse_run(argv)
    except ValueError as exc:
        print(f"mea-pretrain: error: {exc}", file=sys.stderr)
        return 2
    from megatron_mea.checkpoint.errors import CheckpointError
    from megatron_mea.data import DatasetError
    from megatron_mea.apps.training.errors import (
        CollectiveTimeout,
        RunFailure,
        TrainingInterrupted,
        TrainingStopped,
    )
    from megatron_mea.apps.training.loop import pretrain
    from megatron_mea.apps.training.run_dir import RunDirectoryError

    try:
        pretrain(args, config)
    except KeyboardInterrupt:  # Ctrl-C before the signal handler is installed, or without it
        print("mea-pretrain: interrupted by SIGINT before training began, or without "
              "--exit-signal-handler: no checkpoint saved", file=sys.stderr)
        return 130
    except (CheckpointError, RunDirectoryError, DatasetError) as exc:
        print(f"mea-pretrain: error: {exc}", file=sys.stderr)
        return 2
    except TrainingInterrupted as exc:
        print(f"mea-pretrain: {exc}", file=sys.stderr)
        return 128 + exc.signum
    except (CollectiveTimeout, RunFailure) as exc:
        print(f"mea-pretrain: error: {exc}", file=sys.stderr)
        return 1
    except TrainingStopped as exc:
        print(f"mea-pretrain: stopped: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
