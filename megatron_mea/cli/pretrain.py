"""`mea-pretrain`: Megatron-Core pretraining with MEA / KHA (also `python -m megatron_mea.pretrain`).

Launch with torchrun on one or many nodes (NCCL on GPUs, gloo on CPU), or plainly for one process:

    torchrun --nproc-per-node 2 -m megatron_mea.pretrain --config run.yaml --tensor-model-parallel-size 2
"""

import logging
import sys

from megatron_mea.cpu import megatron_on_cpu


@megatron_on_cpu()
def main(argv=None) -> int:
    """Parse and validate the arguments (before anything starts), then train."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    from megatron_mea.training.arguments import parse_args

    try:
        args = parse_args(argv)
    except ValueError as exc:
        print(f"mea-pretrain: error: {exc}", file=sys.stderr)
        return 2
    from megatron_mea.training.checkpointing import CheckpointError
    from megatron_mea.training.loop import TrainingStopped, pretrain

    try:
        pretrain(args)
    except (TrainingStopped, CheckpointError) as exc:
        print(f"mea-pretrain: stopped: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
